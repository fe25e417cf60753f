"""What crosses between the asyncio side and the engine thread: requests, commands, outputs.

Commands go in through one thread-safe queue (``Command``); outputs come back through
``loop.call_soon_threadsafe`` into each request's own ``asyncio.Queue`` (its ``Sink``), one
wake-up per loop per step (``deliver``).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from tokenwire.engine.base import EngineOutput, FinishReason, SamplingParams
from tokenwire.engine.hf.multimodal import RequestMedia
from tokenwire.engine.hf.sampling import RowSampler


@dataclass(slots=True)
class Sink:
    """Where a request's outputs go: its event loop and queue (touched only on that loop)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[EngineOutput | BaseException]


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


@dataclass(slots=True)
class Add:
    request: Request


@dataclass(slots=True)
class Abort:
    request_id: str


class Stop:
    pass


Command = Add | Abort | Stop
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
