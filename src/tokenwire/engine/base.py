"""The contract between the pipeline and any engine (hf on CPU/CUDA, vLLM's on GPUs or CPU).

The pipeline only ever sees these types. One engine request is one sequence: the pipeline's
generation job makes one per choice. Requests arrive checked (``pipeline.validation``: prompt ids
in the vocabulary, prompt + ``max_tokens`` within the context) and admitted (the control plane's
gate and weights allow them; a LoRA adapter is resolved to the version the request holds), so
engines do not check them again; they check only what is theirs (media tensors, and with
``check_new_request`` duplicate ids and being up). The contract has three parts, each a protocol
that tests hold every engine to (``test_engine_contract``): ``GenerationEngine``,
``WeightEngine`` and ``AdapterEngine``; ``Engine`` is all three.
"""

from __future__ import annotations

import operator
from collections.abc import AsyncIterator, Collection, Container, Mapping, Sequence
from dataclasses import dataclass, field, fields
from itertools import starmap
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import numpy as np

from tokenwire.weight_transfer import DEFAULT_PACKED_BUFFER_SIZE_BYTES, TensorMeta

FinishReason = Literal["stop", "length", "abort"]
# How a pause treats requests in flight (vLLM's names): "abort" ends them now with their
# partial tokens, "wait" lets them finish, "keep" freezes them until resume.
PauseMode = Literal["abort", "wait", "keep"]
DEFAULT_WEIGHT_VERSION = "default"
# Below this temperature a request samples greedily (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
# vLLM's logprob modes: the model's raw distribution, or the one sampled from (after
# temperature, penalties and top-k/p/min-p).
LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
LOGPROBS_MODES: tuple[LogprobsMode, ...] = ("raw_logprobs", "processed_logprobs")
# Request features an engine may lack; the pipeline refuses a request that needs one its engine
# does not list in ``Engine.features`` (a 400 naming the field) before the engine sees it.
EngineFeature = Literal[
    "prompt_token_id_logprobs",
    "logprob_token_ids",
    "sampling_mask",
    "lora",
    "structured_outputs",
    "routed_experts",
]


_Data = TypeVar("_Data", bound=type)


def pickled_by_fields(cls: _Data) -> _Data:
    """Pickle a slots dataclass as its constructor's arguments: what crosses the job channel of
    ``--api-server-count`` per output (``pipeline.core_channel``). dataclasses' own state
    functions for slots run in Python, field by field: 16 logprobs took 42 µs each way."""
    values = operator.attrgetter(*(f.name for f in fields(cls)))

    def __reduce__(self: Any) -> tuple[type, tuple[Any, ...]]:
        return cls, values(self)

    cls.__reduce__ = __reduce__  # type: ignore[method-assign]
    return cls


class GrammarState(Protocol):
    """One request's position in its output constraint (``tokenwire.structured.grammar``):
    owned by the engine's row sampler, advanced by each token the row samples."""

    def bitmask(self) -> np.ndarray:
        """The ids allowed next, over the model's vocabulary: int32 words, id i at bit i % 32
        of word i // 32 (llguidance's and xgrammar's layout)."""
        ...

    def accept(self, token_id: int) -> None: ...


class Grammar(Protocol):
    """A compiled output constraint, shared and immutable; one state per request from it."""

    def new_state(self) -> GrammarState: ...


@pickled_by_fields
@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling, already validated by the protocol layer; never changed once made.

    Not a frozen dataclass: one is made per choice, and a frozen one's ``__init__`` (a call of
    ``object.__setattr__`` per field) took 6 µs of a short generate's ~150, this one's 2."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token + top k
    prompt_logprobs: int | None = None
    logprobs_mode: LogprobsMode = "raw_logprobs"
    # Teacher scoring: row i holds the ids whose raw logprobs predict prompt token
    # ``prompt_logprob_start + i + 1``; rows are padded to one width with -1 (scored -inf).
    prompt_logprob_token_ids: tuple[tuple[int, ...], ...] | None = None
    prompt_logprob_start: int = 0
    # At each output position, the logprobs of these ids take the place of the top k.
    logprob_token_ids: tuple[int, ...] | None = None
    # Report each step's sampling support (``SamplingSupport``).
    sampling_mask: bool = False
    # Structured outputs: the compiled constraint each sampled token must keep to (None: free).
    # The raw logprob of a constrained token is the model's (vLLM's default); in
    # "processed_logprobs" mode it is the masked, renormalised distribution's.
    grammar: Grammar | None = field(default=None, compare=False)


@pickled_by_fields
@dataclass(slots=True)
class TokenLogprob:
    """The logprob of one chosen token and the top alternatives at its position; never
    changed once made.

    ``top`` holds (token_id, logprob) pairs sorted by logprob, highest first.

    Not a frozen dataclass: one is made per output token, and a frozen one's ``__init__``
    cost 0.9 µs, this one's 0.15 (an output's cross the job channel as rows, remade there;
    prompt logprobs, with their gaps, one by one).
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class SamplingSupport:
    """The ids one step sampled from: those left after top-k, top-p and min-p (the sampled
    token alone for greedy), ascending, and the sampled token's logprob normalised over them."""

    token_ids: tuple[int, ...]
    logprob: float


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One processed image of a prompt (Qwen2-VL style) and where its placeholders sit."""

    pixel_values: Any  # torch.Tensor [patches, patch_dim]
    image_grid_thw: Any  # torch.Tensor [1, 3]
    offset: int  # first placeholder token in the prompt
    length: int  # number of placeholder tokens


@dataclass(frozen=True, slots=True)
class MultiModalInput:
    """The media of one request, in prompt order; passed as ``media`` to ``Engine.generate``."""

    images: tuple[ImageInput, ...]


@dataclass(slots=True)
class EngineOutput:
    """An incremental result: the tokens made since the previous output of the same request.

    ``stop_reason`` says why a choice stopped, as vLLM's output does; it is set only on the
    final output. It is the token id when one of ``stop_token_ids`` ended the choice (the id is
    the last of ``new_token_ids``), and None when eos ended it (vLLM reports eos as None too),
    for "length" and "abort", and on every earlier output. A ``str`` is the stop string that
    ended it: set by the pipeline's generation job, which matches stop strings above the engine.
    """

    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # The weight version that sampled ``new_token_ids`` (one version per output).
    weight_version: str = DEFAULT_WEIGHT_VERSION
    # Sent once, with the first output: None for the first prompt position.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_prompt_tokens: int = 0
    # Prompt tokens whose KV came from a prefix cache (first output; 0 for engines without one).
    num_cached_tokens: int = 0
    # Teacher scoring, sent once with the first output: float32 [rows, ids], the logprob of
    # ``prompt_logprob_token_ids[i][j]`` at row i (-inf for padding).
    prompt_token_id_logprobs: np.ndarray | None = None
    # One per new token when ``sampling_mask`` was asked.
    sampling_masks: list[SamplingSupport] | None = None
    # With routing capture on (feature "routed_experts"): the routed experts of the positions
    # whose KV was made since the previous output, ``[rows, layers, top_k]`` uint8/uint16 (the
    # first output: the prompt's, cached positions included; then one per fed token). Over a
    # whole request they cover every position but the last sampled token (never fed).
    routed_experts: np.ndarray | None = None


_LOGPROB_ROW = operator.attrgetter(*(f.name for f in fields(TokenLogprob)))
_OUTPUT_AFTER_LOGPROBS = operator.attrgetter(*(f.name for f in fields(EngineOutput)[2:]))


def _reduce_engine_output(output: EngineOutput) -> tuple[Any, tuple[Any, ...]]:
    """An output pickles as its constructor's arguments, its logprobs as rows of plain
    tuples (pickle's C code), not one reduce call per ``TokenLogprob``: 16 logprobs crossed
    the job channel in 36 µs, now in 16."""
    rows = None if output.logprobs is None else list(map(_LOGPROB_ROW, output.logprobs))
    return _engine_output, (output.new_token_ids, rows, *_OUTPUT_AFTER_LOGPROBS(output))


def _engine_output(new_token_ids: list[int], logprob_rows: Any, *rest: Any) -> EngineOutput:
    logprobs = None if logprob_rows is None else list(starmap(TokenLogprob, logprob_rows))
    return EngineOutput(new_token_ids, logprobs, *rest)


EngineOutput.__reduce__ = _reduce_engine_output  # type: ignore[method-assign,assignment]


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int
    waiting: int
    max_num_seqs: int
    extra: dict[str, Any] = field(default_factory=dict)


class EngineError(Exception):
    """A request the engine cannot serve (e.g. too long); mapped to a 400 by the api layer."""


class EngineDead(Exception):
    """The engine stopped for good: its thread or process died. A server fault (503), never a
    client's: every request in flight and after it fails with it, and the server exits."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"The engine died ({reason}); this server is exiting")
        self.reason = reason

    def __reduce__(self) -> tuple[type, tuple[str]]:  # crosses the job channel as it was
        return EngineDead, (self.reason,)


def check_running(ready: bool, death: str | None) -> None:
    """``EngineDead`` once the engine died (``death``); else ``EngineError`` unless it is up
    (``is_ready``): what it refuses before start or after shutdown."""
    if death is not None:
        raise EngineDead(death)
    if not ready:
        raise EngineError("the engine is not running")


def check_new_request(
    ready: bool, death: str | None, request_id: str, in_flight: Container[str]
) -> None:
    """What every engine's ``generate`` refuses before its own checks: a dead engine
    (``EngineDead``), one that is not up, and a request id already in flight (its outputs would
    mix; both ``EngineError``)."""
    check_running(ready, death)
    if request_id in in_flight:
        raise EngineError(f"request id {request_id!r} is already running")


class WeightsError(EngineError):
    """New weights that do not fit the running model; the old weights stay."""


class WeightTransferError(Exception):
    """A weight broadcast that broke off (the trainer died, stalled past the timeout, or the
    group failed): the model may hold some of the new tensors, and the group is gone."""


@dataclass(frozen=True, slots=True)
class WeightGroup:
    """Where and how an engine joins a trainer's weight-transfer group (``weight_transfer``)."""

    master_address: str
    master_port: int
    rank: int
    world_size: int
    backend: str
    group_name: str | None  # None: the trainer's default group (``weight_transfer``)
    timeout_s: float


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """Tensors to receive over the group, in broadcast order; ``packed``: as vLLM's packed
    chunks of ``buffer_size_bytes``, else one broadcast per tensor."""

    tensors: tuple[TensorMeta, ...]
    packed: bool = False
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES


@dataclass(frozen=True, slots=True)
class AdapterTensors:
    """A PEFT LoRA adapter in memory, as a trainer sends it without writing it to disk: the
    fields of its ``adapter_config.json`` and its factors under PEFT's names
    (``base_model.model.<module>.lora_A.weight``; torch tensors)."""

    config: Mapping[str, Any]
    tensors: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    """One load of a LoRA adapter, as the pipeline's adapter registry made it: an engine holds
    it under ``id`` (unique per load) from ``load_adapter`` to ``unload_adapter``, and the
    tokens a request under it samples carry ``version``."""

    name: str
    version: str
    id: int


class GenerationEngine(Protocol):
    """Requests in, outputs out; pause and resume between steps."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # known once started
    # As vLLM's config reports it (``/server_info``), once started: ``"torch.bfloat16"``.
    dtype: str
    features: frozenset[EngineFeature]
    weight_version: str  # what tokens sampled now carry (an adapter's requests: its version)

    async def start(self) -> None: ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        media: MultiModalInput | None = None,
        cache_salt: str | None = None,
        *,
        adapter: AdapterVersion | None = None,
        final_only: bool = False,
    ) -> AsyncIterator[EngineOutput]:
        """Yield outputs until one carries a finish_reason. Closing the iterator aborts.

        Requests with different ``cache_salt`` never share prefix-cache blocks (vLLM's).
        ``adapter``: a LoRA adapter version the engine holds (None: the base model).
        ``final_only``: the caller reads nothing before the end (a non-streamed answer with no
        stop string to find on the way), so the engine may hold its outputs and send them all
        when the request ends; each output still holds the tokens of one weight version."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Abort a running or queued request; its stream ends with finish_reason "abort"."""
        ...

    def stats(self) -> EngineStats: ...

    def is_ready(self) -> bool: ...

    def death(self) -> str | None:
        """Why the engine died (its thread or process ended while it served), None while it
        has not. Set once and never cleared: the one record of it, which every check reads."""
        ...

    async def shutdown(self) -> None: ...

    async def pause(self, mode: PauseMode, *, clear_cache: bool = False) -> int:
        """Stop stepping; return how many requests were in flight. ``"wait"`` returns once they
        finished; ``clear_cache`` drops kept requests' KV so they recompute on resume."""
        ...

    async def resume(self) -> None: ...

    async def reset_prefix_cache(self) -> bool: ...


class WeightEngine(Protocol):
    """The base model's weights: from a checkpoint, or from the trainer's process group. The
    control plane's weight lifecycle calls these one at a time, between engine steps."""

    async def load_weights(self, weight_dir: Path, version: str) -> None:
        """Swap in a checkpoint of the same architecture (``WeightsError`` if it does not fit,
        or a file of it cannot be read whole: the old weights stay; ``WeightTransferError``
        when that happens after some layers loaded); tokens sampled afterwards carry
        ``version``."""
        ...

    async def set_weight_version(self, version: str) -> None: ...

    def weight_transfer_backends(self) -> tuple[str, ...]:
        """The ``torch.distributed`` backends this engine can receive weights over (none: it
        cannot)."""
        ...

    async def join_weight_group(self, group: WeightGroup) -> None:
        """Join the trainer's group (blocks until every rank joined; off the event loop)."""
        ...

    async def leave_weight_group(self) -> None:
        """Leave the group, if joined (else nothing)."""
        ...

    def check_weight_update(self, tensors: Sequence[TensorMeta]) -> None:
        """``WeightsError`` unless every tensor names a weight of that shape, in a dtype it can
        take; nothing is received before this passes."""
        ...

    async def receive_weights(self, update: WeightUpdate) -> None:
        """Receive ``update`` (checked) into the model between steps; ``WeightTransferError``
        when the broadcast breaks off (the engine has left the group then)."""
        ...

    def missing_weights(self, given: Collection[str]) -> list[str]:
        """The model's weights ``given`` leaves out (tied weights count as given with their
        twin)."""
        ...

    async def copy_weights(self, tensors: dict[str, Any]) -> None:
        """Copy some of the model's weights (checked first: ``WeightsError``) between steps."""
        ...


class AdapterEngine(Protocol):
    """LoRA adapter versions (engines whose ``features`` hold "lora"). The registry decides
    which versions live and counts them against ``--max-loras``; an engine keeps one spare slot
    beyond that for the version a load replaces, which leaves right after."""

    async def load_adapter(self, adapter: AdapterVersion, source: AdapterTensors) -> None:
        """Load a PEFT adapter (read and checked against the allowed paths by the registry,
        from its directory or a trainer's memory) under ``adapter``; ``WeightsError`` if it
        does not fit, and nothing changes."""
        ...

    async def unload_adapter(self, adapter: AdapterVersion) -> None:
        """Forget ``adapter`` (no request holds it any more)."""
        ...

    def check_adapter_update(
        self, config: Mapping[str, Any], tensors: Sequence[TensorMeta]
    ) -> None:
        """``WeightsError`` unless each tensor is a LoRA factor the model can take under
        ``config`` (an adapter's tensors may come in several updates: whether every factor came
        is checked when it loads); nothing is received before this passes."""
        ...

    async def receive_tensors(self, update: WeightUpdate) -> dict[str, Any]:
        """Receive ``update`` into new tensors (an adapter's: the model is untouched), off the
        engine thread; ``WeightTransferError`` when the broadcast breaks off."""
        ...


class Engine(GenerationEngine, WeightEngine, AdapterEngine, Protocol):
    """What every engine provides."""
