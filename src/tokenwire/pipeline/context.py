"""What every pipeline call reads: the serving config and the loaded model, built once.

``Settings`` (flags and environment) are resolved here, at start-up, into runtime objects
(parser instances, limits); nothing below reads a flag by name.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenwire.engine.base import Engine, PauseMode
from tokenwire.media.service import MediaService
from tokenwire.parsers import ReasoningParser, ToolParser, get_reasoning_parser, get_tool_parser
from tokenwire.pipeline.errors import NotReady, UnknownModel
from tokenwire.pipeline.jobs import JobRegistry
from tokenwire.pipeline.session_store import SessionStore
from tokenwire.settings import Settings
from tokenwire.text.chat_template import ChatTemplate, RequestTemplateWorkers
from tokenwire.text.token_text import TokenTextDecoder
from tokenwire.text.tokenizer import Tokenizer
from tokenwire.weight_transfer import TensorMeta, WeightTransferConfig


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """The request-path parts of ``Settings``, resolved once."""

    model_names: tuple[str, ...]
    model_root: str
    reasoning_parser: ReasoningParser | None
    tool_parser: ToolParser | None
    enable_auto_tool_choice: bool
    trust_request_chat_template: bool
    max_n: int
    # --max-logprobs as given: -1 means the vocabulary size (see pipeline.logprob_limit).
    max_logprobs: int
    max_held_requests: int  # that may wait out SGLang's /pause_generation at once
    # SGLang's --incremental-streaming-output: /generate stream chunks carry deltas.
    incremental_streaming_output: bool
    # --weight-transfer-config; None: vLLM's weight-transfer routes are refused.
    weight_transfer: WeightTransferConfig | None = None
    max_loras: int = 0  # LoRA adapter versions resident at once; 0: LoRA off
    max_lora_rank: int = 0

    @classmethod
    def from_settings(cls, settings: Settings) -> ServingConfig:
        return cls(
            model_names=settings.model_names,
            model_root=settings.model,
            reasoning_parser=(
                get_reasoning_parser(settings.reasoning_parser)
                if settings.reasoning_parser
                else None
            ),
            tool_parser=(
                get_tool_parser(settings.tool_call_parser) if settings.tool_call_parser else None
            ),
            enable_auto_tool_choice=settings.enable_auto_tool_choice,
            trust_request_chat_template=settings.trust_request_chat_template,
            max_n=settings.max_n,
            max_logprobs=settings.max_logprobs,
            max_held_requests=settings.max_held_requests,
            incremental_streaming_output=settings.incremental_streaming_output,
            weight_transfer=settings.weight_transfer_config,
            max_loras=settings.max_loras if settings.enable_lora else 0,
            max_lora_rank=settings.max_lora_rank,
        )

    @property
    def served_name(self) -> str:
        return self.model_names[0]


@dataclass(slots=True)
class ModelRuntime:
    """The loaded model: available once loading finished."""

    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    engine: Engine
    max_model_len: int
    # The one vocabulary bound of every id check: ids the model embeds and the tokenizer decodes.
    vocab_size: int
    # Ids that end a choice on their own (eos); never part of the text a client reads.
    eos_token_ids: frozenset[int]
    # Fetches and processes media for every entry point; refuses it for text-only models.
    media: MediaService
    # Exact token texts and incremental decoding: every path from ids to text goes through it.
    decoder: TokenTextDecoder
    # The processes request templates render in; None unless --trust-request-chat-template.
    request_templates: RequestTemplateWorkers | None = None


@dataclass(slots=True)
class TransferGroup:
    """The open weight-transfer group, as ``init_info`` set it up."""

    group_name: str
    packed: bool
    buffer_size_bytes: int


@dataclass(slots=True)
class TransferState:
    """vLLM's four phases (see ``pipeline.weight_transfer``); one call at a time (``lock``)."""

    group: TransferGroup | None = None
    updating: bool = False  # between start and finish
    received: set[str] = field(default_factory=set)  # tensor names of this update so far
    previous: tuple[TensorMeta, ...] = ()  # what empty update_info lists repeat
    # Why the weights are broken (an update that broke off or came incomplete): generation is
    # refused until a complete update or a checkpoint reload.
    failed: str | None = None
    paused: bool = False  # the engine pause an update took itself, lifted when it completes
    # An update that targets a LoRA adapter: its factors gather here until finish loads them.
    adapter: StagedAdapter | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(slots=True)
class StagedAdapter:
    """A LoRA adapter's factors received so far in an update (``update_info.lora_name``)."""

    name: str
    config: dict[str, Any]
    tensors: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ControlState:
    """What the RL control routes set (see ``pipeline.control``); every new request reads it."""

    pause_mode: PauseMode | None = None
    # Memory tags put to sleep (/sleep, /release_memory_occupation) and not woken yet; new
    # requests are refused while any is left, as vLLM's engine sleeps until all are woken.
    asleep: frozenset[str] = frozenset()
    # SGLang's /pause_generation: new requests wait (``held`` of them now) until ``continued``
    # is set by a resume, where vLLM's pause answers them 503.
    holding: bool = False
    continued: asyncio.Event = field(default_factory=asyncio.Event)
    held: int = 0
    reloads: int = 0  # numbers the versions of reloads that name none
    # Counts resumes, so a pause that a resume overtook (a "wait" still draining) can say so.
    resumes: int = 0
    transfer: TransferState = field(default_factory=TransferState)

    @property
    def sleeping(self) -> bool:
        return bool(self.asleep)


@dataclass(frozen=True, slots=True)
class Adapter:
    """A loaded LoRA adapter as clients see it (``pipeline.lora`` loads and unloads them), and
    the ``adapter_config.json`` it loaded with (new factors sent alone reuse it)."""

    name: str
    path: str  # its directory, or ``pipeline.lora.MEMORY_ADAPTER_PATH``
    version: str
    config: dict[str, Any]


@dataclass(slots=True)
class Adapters:
    """The loaded LoRA adapters by name; ``lock`` orders loads and unloads."""

    allowed_roots: tuple[Path, ...] = ()  # empty: any path the server can read
    loaded: dict[str, Adapter] = field(default_factory=dict)
    loads: int = 0  # numbers the versions of loads that name none
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(slots=True)
class Pipeline:
    """The server's state as the pipeline sees it; one per app."""

    config: ServingConfig
    runtime: ModelRuntime | None = None
    shutting_down: bool = False
    load_error: str | None = None
    jobs: JobRegistry = field(default_factory=JobRegistry)
    control: ControlState = field(default_factory=ControlState)
    adapters: Adapters = field(default_factory=Adapters)
    # The recorded sessions (X-Session-ID); the app opens it at start.
    sessions: SessionStore | None = None

    def session_store(self) -> SessionStore:
        assert self.sessions is not None, "the app opens the session store at start"
        return self.sessions

    def shut_down(self) -> None:
        """Refuse every request not yet in the engine (503), from now on and those that wait
        out SGLang's pause now; requests in the engine go on."""
        self.shutting_down = True
        self.control.continued.set()  # held requests look again, and find the server closing

    def ready(self, model: str | None = None) -> ModelRuntime:
        """The loaded model for a request naming ``model`` (missing or empty: the served one;
        a LoRA adapter's name: the model it adapts)."""
        if self.runtime is None or self.shutting_down:
            raise NotReady(
                "The server is shutting down" if self.shutting_down else "The model is loading"
            )
        if model and model not in self.config.model_names and model not in self.adapters.loaded:
            raise UnknownModel(model)
        return self.runtime

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model)."""
        return model if model and model in self.adapters.loaded else None
