"""A frontend's end of the job channel (``pipeline.core_channel``): its jobs run in the core.

``CoreLink`` is the connection; ``CoreEngine`` is what the frontend's runtime holds as its
engine (the facts checks and renders read, and the core's death as the engine's); a job opened
here (``RemoteJob``) is what its ``GenerationJob`` runs its choices on, in place of an engine.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

from tokenwire.engine.base import (
    AdapterVersion,
    EngineDead,
    EngineError,
    EngineOutput,
    EngineStats,
    MultiModalInput,
    SamplingParams,
    check_running,
)
from tokenwire.pipeline.core_channel import EngineFacts, Frames, JobSpec


class CoreLink(Frames):
    """One frontend's connection to the core, its jobs multiplexed by call number."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self._calls = itertools.count()
        self._replies: dict[int, asyncio.Future[tuple[Any, ...]]] = {}
        self._streams: dict[tuple[int, int], asyncio.Queue[Any]] = {}
        self.death: str | None = None
        self.facts: EngineFacts | None = None

    async def connect(self, timeout_s: float) -> EngineFacts:
        """Connect (the core may still be starting) and wait for its engine's facts."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                await loop.create_unix_connection(lambda: self, self.path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(0.05)
        reply = await self._ask("hello")
        self.facts = reply[2]
        return reply[2]

    async def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def open_job(self, spec: JobSpec) -> RemoteJob:
        """Have the core admit and register a job (its errors raised here, as one process
        raises them); run its choices on the returned job."""
        call = next(self._calls)
        # The core runs the choices once admitted: their outputs may follow "opened" at once.
        count = len(spec.choices)
        for index in range(count):
            self._streams[call, index] = asyncio.Queue()
        try:
            await self._ask("open", call, spec)
        except BaseException:
            for index in range(count):
                self._streams.pop((call, index), None)
            raise
        return RemoteJob(self, call, [choice.engine_id for choice in spec.choices])

    async def check_model(self, name: str) -> None:
        """Raise what the core's ``ready(name)`` raises (``UnknownModel``: no adapter of that
        name is loaded)."""
        await self._ask("model", None, name)

    def post(self, *message: Any) -> None:
        check_running(self.transport is not None, self.death)
        self.send(message)

    async def _ask(self, kind: str, call: int | None = None, *args: Any) -> tuple[Any, ...]:
        if call is None:
            call = next(self._calls)
        reply = asyncio.get_running_loop().create_future()
        self._replies[call] = reply
        try:
            self.post(kind, call, *args)
            return await reply
        except asyncio.CancelledError:
            if kind == "open" and self.death is None:  # admitted after its client left
                self.send(("close", call))
            raise
        finally:
            self._replies.pop(call, None)

    def stream(self, call: int, index: int) -> asyncio.Queue[Any]:
        return self._streams[call, index]

    def forget(self, call: int, index: int) -> None:
        self._streams.pop((call, index), None)

    def received(self, message: tuple[Any, ...]) -> None:
        kind, call = message[0], message[1]
        if kind == "out" or (kind == "error" and message[2] is not None):
            queue = self._streams.get((call, message[2]))
            if queue is not None:
                queue.put_nowait(message[3] if kind == "out" else _Raised(message[3]))
            return
        reply = self._replies.get(call)
        if reply is None or reply.done():
            return
        if kind == "error":
            reply.set_exception(message[3])
        else:
            reply.set_result(message)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.death = "the core process closed the job channel"
        failure = EngineDead(self.death)
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(failure)
        for queue in self._streams.values():
            queue.put_nowait(_Raised(failure))


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class RemoteJob:
    """A job the core admitted: its choices' engine requests, run there by engine id. Offers
    ``GenerationJob`` what an engine does (``generate``, ``abort``, ``features``)."""

    def __init__(self, link: CoreLink, call: int, engine_ids: list[str]) -> None:
        self.link = link
        self.call = call
        self._index = {engine_id: index for index, engine_id in enumerate(engine_ids)}
        self._unfinished = len(engine_ids)
        assert link.facts is not None, "jobs open once the link is connected"
        self.features = link.facts.features

    async def generate(
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
        """The outputs of the choice ``request_id``, which the core runs since ``open_job``
        (with what it was sent then); leaving early stops it in the core, which aborts it."""
        index = self._index[request_id]
        link = self.link
        queue = link.stream(self.call, index)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, _Raised):
                    finished = True
                    raise item.error
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            link.forget(self.call, index)
            if finished:
                self._unfinished -= 1
            elif link.death is None:
                link.send(("stop", self.call, index))

    async def abort(self, request_id: str) -> bool:
        self.link.post("abort", self.call, self._index[request_id])
        return True

    def close(self) -> None:
        """The job ended here. The core ended it too once every choice finished; else it
        aborts what still runs and releases what it held."""
        for index in self._index.values():
            self.link.forget(self.call, index)
        if self._unfinished and self.link.death is None:
            self._unfinished = 0
            self.link.send(("close", self.call))


class CoreEngine:
    """The engine as a frontend sees it: the core's engine's facts, and the core's death as
    its own. Jobs do not run here: ``pipeline.generate.start_job`` opens them on the link."""

    def __init__(self, link: CoreLink, connect_timeout_s: float = 600.0) -> None:
        self.link = link
        self._connect_timeout_s = connect_timeout_s
        self._facts: EngineFacts | None = None

    @property
    def facts(self) -> EngineFacts:
        assert self._facts is not None, "the frontend reads the facts once started"
        return self._facts

    model_name = property(lambda self: self.facts.model_name)
    max_model_len = property(lambda self: self.facts.max_model_len)
    vocab_size = property(lambda self: self.facts.vocab_size)
    eos_token_ids = property(lambda self: self.facts.eos_token_ids)
    dtype = property(lambda self: self.facts.dtype)
    features = property(lambda self: self.facts.features)

    async def start(self) -> None:
        self._facts = await self.link.connect(self._connect_timeout_s)

    async def shutdown(self) -> None:
        await self.link.close()

    def is_ready(self) -> bool:
        return self._facts is not None and self.link.death is None

    def death(self) -> str | None:
        return self.link.death

    def stats(self) -> EngineStats:
        """This frontend runs nothing itself: the load routers read is the core's."""
        return EngineStats(running=0, waiting=0, max_num_seqs=0)

    def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[EngineOutput]:
        raise EngineError("a frontend runs its jobs in the core (CoreLink.open_job)")
