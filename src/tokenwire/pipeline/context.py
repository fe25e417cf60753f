"""What every pipeline call reads: the serving config and the loaded model, built once.

``Settings`` (flags and environment) are resolved here, at start-up, into runtime objects
(parser instances, limits); nothing below reads a flag by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenwire.engine.base import Engine, EngineDead, LogprobsMode
from tokenwire.media.service import MediaService
from tokenwire.parsers import ReasoningParser, ToolParser, get_reasoning_parser, get_tool_parser
from tokenwire.pipeline.control import ControlPlane
from tokenwire.pipeline.control.trainer_address import TrainerAddressPolicy
from tokenwire.pipeline.core_link import CoreLink
from tokenwire.pipeline.errors import NotReady, UnknownModel
from tokenwire.pipeline.jobs import JobRegistry
from tokenwire.pipeline.prompt_memory import PromptMemory
from tokenwire.pipeline.session_store import SessionStore
from tokenwire.settings import Settings
from tokenwire.structured.grammar import GrammarCompiler
from tokenwire.text.chat_template import ChatTemplate, RequestTemplateWorkers
from tokenwire.text.token_text import TokenTextDecoder
from tokenwire.text.tokenizer import Tokenizer
from tokenwire.weight_transfer import WeightTransferConfig


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
    # --weight-transfer-allowed-hosts: the trainer addresses an init may dial.
    trainer_addresses: TrainerAddressPolicy = field(default_factory=TrainerAddressPolicy)
    # --logprobs-mode: what a request that names no mode gets.
    logprobs_mode: LogprobsMode = "raw_logprobs"
    max_loras: int = 0  # LoRA adapter versions resident at once; 0: LoRA off
    prompt_memory_bytes: int = 2**30  # --prompt-memory-bytes
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
            trainer_addresses=TrainerAddressPolicy.from_flag(
                settings.weight_transfer_allowed_hosts
            ),
            logprobs_mode=settings.logprobs_mode,
            max_loras=settings.max_loras if settings.enable_lora else 0,
            max_lora_rank=settings.max_lora_rank,
            prompt_memory_bytes=settings.prompt_memory_bytes,
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
    # Compiles structured-output constraints (None: the engine cannot enforce them).
    grammars: GrammarCompiler | None = None


@dataclass(slots=True)
class Pipeline:
    """The server's state as the pipeline sees it; one per app."""

    config: ServingConfig
    runtime: ModelRuntime | None = None
    load_error: str | None = None
    jobs: JobRegistry = field(default_factory=JobRegistry)
    # The recorded sessions (X-Session-ID); the app opens it at start.
    sessions: SessionStore | None = None
    allowed_lora_roots: tuple[Path, ...] = ()  # --allowed-lora-paths, resolved
    # A frontend of --api-server-count: its jobs are admitted and run in the core, which owns
    # the control plane, the jobs, sessions and remembered prompts (None: this process does).
    core: CoreLink | None = None
    control: ControlPlane = field(init=False)
    # The prompts renders and extends remember for an extend to name.
    prompt_memory: PromptMemory = field(init=False)

    def __post_init__(self) -> None:
        config = self.config
        self.control = ControlPlane(
            lambda: self.ready().engine,
            self.jobs,
            weight_transfer=config.weight_transfer,
            trainer_addresses=config.trainer_addresses,
            max_held_requests=config.max_held_requests,
            max_loras=config.max_loras,
            base_model_names=config.model_names,
            allowed_lora_roots=self.allowed_lora_roots,
        )
        self.prompt_memory = PromptMemory(config.prompt_memory_bytes)

    def session_store(self) -> SessionStore:
        assert self.sessions is not None, "the app opens the session store at start"
        return self.sessions

    @property
    def shutting_down(self) -> bool:
        return self.control.gate.draining

    @property
    def engine_death(self) -> str | None:
        """Why the engine died (None: it has not, or it is not loaded); the engine's own
        record, read here for every route, /health, /metrics and the server's exit."""
        if self.core is not None:  # a frontend: its link is its engine, loaded or not
            return self.core.death
        return None if self.runtime is None else self.runtime.engine.death()

    def shut_down(self) -> None:
        """Refuse every request not yet in the engine (503), from now on and those that wait
        out SGLang's pause now; requests in the engine go on."""
        self.control.close()

    def ready(self, model: str | None = None) -> ModelRuntime:
        """The loaded model for a request naming ``model`` (missing or empty: the served one;
        a LoRA adapter's name: the model it adapts). ``EngineDead`` (a 503) once the engine
        died: the server is going down, nothing it answers now would outlive it."""
        death = self.engine_death
        if death is not None:
            raise EngineDead(death)
        if self.runtime is None or self.shutting_down:
            raise NotReady(
                "The server is shutting down" if self.shutting_down else "The model is loading"
            )
        if (
            model
            and model not in self.config.model_names
            and self.core is None  # a frontend: the core knows the adapters
            and model not in self.control.adapters.loaded
        ):
            raise UnknownModel(model)
        return self.runtime

    async def ready_without_job(self, model: str | None) -> ModelRuntime:
        """``ready(model)`` for a route a frontend answers without a job (/tokenize,
        /detokenize): only the core knows which adapters are loaded, so a frontend asks it
        about a name that is not the served model's (a 404 as one process answers)."""
        runtime = self.ready(model)
        if self.core is not None and (adapter := self.adapter_of(model)) is not None:
            await self.core.check_model(adapter)
        return runtime

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model)."""
        if self.core is not None:
            return model if model and model not in self.config.model_names else None
        return self.control.adapters.name_of(model)
