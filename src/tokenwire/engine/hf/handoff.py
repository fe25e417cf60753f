"""What crosses between the asyncio side and the engine thread: requests, commands, outputs.

Commands go in through one thread-safe queue (``Command``); outputs come back through
``loop.call_soon_threadsafe`` into each request's own ``asyncio.Queue`` (its ``Sink``), one
wake-up per loop per step (``deliver``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenwire.engine.base import (
    AdapterVersion,
    EngineOutput,
    FinishReason,
    PauseMode,
    SamplingParams,
)
from tokenwire.engine.hf.lora import AdapterWeights
from tokenwire.engine.hf.multimodal import RequestMedia
from tokenwire.engine.hf.routing import RouteLog
from tokenwire.engine.hf.sampling import RowSampler


@dataclass(slots=True)
class Sink:
    """Where a request's outputs go: its event loop and queue (touched only on that loop)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[EngineOutput | BaseException]


@dataclass(slots=True)
class PrefillProgress:
    """A context prefilled one chunk per step, between chunks: the request waits in the queue
    with its own cache of the first ``done`` context tokens."""

    cache: Any  # a DynamicCache, one row, no padding
    done: int
    scores: Any  # the runner's PromptScores so far, when the request scores its prompt


@dataclass(slots=True)
class Request:
    """A request as the engine thread tracks it."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    sink: Sink
    media: RequestMedia | None = None
    # M-RoPE: decode token i sits at position i + rope_delta (negative after images, else 0).
    rope_delta: int = 0
    sampler: RowSampler | None = None
    output: list[int] = field(default_factory=list)
    last_token: int = 0
    finish: FinishReason | None = None
    # Its KV was dropped while paused (clear_cache): prefill prompt + output again, emit no
    # prompt logprobs, keep the sampler (its history and generator state).
    recompute: bool = False
    # The prompt has images: their pixels are freed after prefill, so it cannot recompute.
    has_images: bool = False
    # Prefix cache: the keys of the prompt's full blocks (computed once), and how many context
    # tokens the next prefill takes from the cache.
    prompt_keys: list[bytes] | None = None
    num_cached: int = 0
    salt: bytes = b""  # ``prefix_cache.salt_key`` of its cache_salt
    # New weights came in after its prefill: its KV mixes two weight versions, keep none of it.
    stale_kv: bool = False
    # The LoRA adapter version it runs under (None: the base model; its tokens report that
    # version, and its KV's prefix-cache keys are salted with it), and the slot its rows use
    # (0: none), found when the request arrives.
    adapter: AdapterVersion | None = None
    adapter_slot: int = 0
    # A prompt longer than one prefill forward, part-way through (see ``PrefillProgress``).
    progress: PrefillProgress | None = None
    # The scheduler's prefill clock when it arrived: where it ranks among waiting prefills.
    admitted_at: int = 0
    # Its context's routed experts, with routing capture on (``routing``).
    routes: RouteLog | None = None

    @property
    def context(self) -> list[int]:
        """The ids whose KV the next prefill computes."""
        return [*self.prompt, *self.output] if self.recompute else self.prompt

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prefill scores the prompt (top-k prompt logprobs, given ids' logprobs or both)."""
        p = self.params
        asked = p.prompt_logprobs is not None or p.prompt_logprob_token_ids is not None
        return asked and not self.recompute

    @property
    def seeded(self) -> bool:
        """A seed promises the same ids whatever else runs: the row is computed batch-invariantly
        (prefilled alone, decode attention over its own tokens; see invariance.py)."""
        return self.params.seed is not None


@dataclass(slots=True)
class Add:
    request: Request


@dataclass(slots=True)
class Abort:
    request_id: str


class Stop:
    pass


@dataclass(slots=True)
class Reply:
    """Where the engine thread answers a control command: a future on the caller's loop."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]

    @classmethod
    def here(cls) -> Reply:
        loop = asyncio.get_running_loop()
        return cls(loop, loop.create_future())

    def send(self, value: Any) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is waiting
            self.loop.call_soon_threadsafe(_resolve, self.future, value)


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


@dataclass(slots=True)
class Pause:
    mode: PauseMode
    clear_cache: bool
    reply: Reply


@dataclass(slots=True)
class Resume:
    reply: Reply


@dataclass(slots=True)
class NewWeights:
    """Weights to put into the model between steps: ``load`` runs on the engine thread (a
    checkpoint read off it and copied in, or a broadcast received); ``version`` (None: kept)
    names them once ``load`` returns."""

    load: Callable[[], None]
    version: str | None
    reply: Reply


@dataclass(slots=True)
class LoadAdapter:
    adapter: AdapterVersion
    weights: AdapterWeights
    reply: Reply


@dataclass(slots=True)
class UnloadAdapter:
    adapter: AdapterVersion
    reply: Reply


@dataclass(slots=True)
class SetVersion:
    version: str
    reply: Reply


@dataclass(slots=True)
class ResetPrefixCache:
    reply: Reply


Command = (
    Add
    | Abort
    | Stop
    | Pause
    | Resume
    | NewWeights
    | SetVersion
    | ResetPrefixCache
    | LoadAdapter
    | UnloadAdapter
)
# One step's outputs (or the error that ended a stream), in the order they were made.
Emits = list[tuple[Sink, EngineOutput | BaseException]]


def deliver(emits: Emits) -> None:
    """Hand a step's outputs to their loops, one wake-up per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, Emits] = {}
    for sink, item in emits:
        by_loop.setdefault(sink.loop, []).append((sink, item))
    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening
            loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: Emits) -> None:
    for sink, item in batch:
        sink.queue.put_nowait(item)
