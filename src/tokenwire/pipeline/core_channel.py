"""The job channel of ``--api-server-count``: frontends hand the core what the engine runs.

With N API server processes, one process, the core, owns the engine and every state requests
must agree on: the gate, the weights, the adapters and their versions, the running jobs (abort
by id reaches every process's), sessions and remembered prompts. The N frontends do each
request's text work for the routes they serve (HTTP, validation, render, tokenize, decode,
JSON), and send the core one job at a time, already checked: it admits the job once (the hold
of SGLang's pause, the gate, the adapter version), registers it, runs its choices on the engine
and streams their outputs back. vLLM splits its API servers from its engine core the same way.

One Unix socket connection per frontend carries length-prefixed pickled tuples. The peers are
this server's own processes: the socket lies in a directory only its user can open.

Frontend to core (``call`` numbers a frontend's job on its connection):
- ``("hello", call)``: the engine's facts once it is up (``EngineFacts``), or why it is not;
- ``("open", call, JobSpec)``: admit a job and run its choices; answered ``("opened",
  call)`` or ``("error", call, None, exc)``, then choice i's outputs come as ``("out", call,
  i, EngineOutput)``, or an ``("error", call, i, exc)`` ends it;
- ``("model", call, name)``: whether a request may name ``name`` (an adapter's); answered
  ``("known", call)`` or ``("error", call, None, exc)``;
- ``("abort", call, index)``: the engine aborts the choice (its stream ends with "abort");
- ``("stop", call, index)``: the frontend left the stream (closing it aborts the request);
- ``("close", call)``: the job ended early; what still runs is aborted, its adapter version
  released. A job whose choices all ended ends in the core on its own, and a connection that
  drops ends its jobs as ``close`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import struct
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tokenwire.engine.base import (
    AdapterVersion,
    EngineFeature,
    MultiModalInput,
    SamplingParams,
    pickled_by_fields,
)
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.structured.grammar import GrammarError

if TYPE_CHECKING:
    from tokenwire.engine.base import Engine
    from tokenwire.pipeline.context import Pipeline

logger = logging.getLogger("tokenwire")

_SIZE = struct.Struct("!I")
_READY_POLL_S = 0.05  # how often a hello looks whether the model finished loading


class Frames(asyncio.Protocol):
    """One end of the channel: whole messages in (``received``), messages out (``send``).

    A protocol, not streams: a frame costs a buffer slice and a ``pickle.loads``, with no
    coroutine per read (every request crosses the channel twice at least)."""

    def __init__(self) -> None:
        self.transport: Any = None  # asyncio's or uvloop's Unix socket transport
        self._buffer = bytearray()
        self._outgoing = bytearray()
        self._writable: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= _SIZE.size:
            (size,) = _SIZE.unpack_from(buffer, start)
            end = start + _SIZE.size + size
            if len(buffer) < end:
                break
            message = pickle.loads(memoryview(buffer)[start + _SIZE.size : end])
            start = end
            self.received(message)
        del buffer[:start]

    def received(self, message: tuple[Any, ...]) -> None:
        raise NotImplementedError

    def send(self, message: tuple[Any, ...]) -> None:
        """Queue ``message``; what one turn of the event loop sends leaves in one write (a
        system call per frame cost more than the rest of the channel)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outgoing += _SIZE.pack(len(data))
        self._outgoing += data

    def _flush(self) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(bytes(self._outgoing))
        self._outgoing.clear()

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    async def drain(self) -> None:
        """Return once the peer reads again (its buffer was full)."""
        if self._writable is not None:
            await self._writable

    def connection_lost(self, exc: Exception | None) -> None:
        self.resume_writing()


def portable(exc: BaseException) -> BaseException:
    """``exc`` as it can cross the channel: the pipeline's and engine's own errors do (they
    map to the same HTTP answer on the other side); anything else becomes an error saying
    what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What a frontend needs of the engine to check and render requests itself."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    features: frozenset[EngineFeature]


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class ChoiceSpec:
    """One choice's engine request as it crosses the channel: its grammar as text (a compiled
    one lives in one process), no adapter (the core resolves the version)."""

    engine_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    grammar_text: str | None
    media: MultiModalInput | None
    cache_salt: str | None
    final_only: bool


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class JobSpec:
    """A job as a frontend asks the core to admit it: what ``start_job`` admits in one process.
    ``adapter``: the LoRA adapter it names (``adapter_param``: the field that names it)."""

    request_id: str
    adapter: str | None
    adapter_param: str
    choices: list[ChoiceSpec]


class JobChannel:
    """The core's end: serves every frontend's jobs from the core's pipeline."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self._server: asyncio.AbstractServer | None = None
        self.connections: set[_Connection] = set()

    async def start(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            await connection.end()


class _ChannelJob:
    """A frontend's job as the core's job registry holds it: abortable by its request id."""

    def __init__(
        self, request_id: str, engine: Engine, requests: list[ChoiceSpec], grammars: list[Any]
    ) -> None:
        self.request_id = request_id
        self.engine = engine
        self.requests = requests
        self.grammars = grammars
        self.version: AdapterVersion | None = None
        self.runs: dict[int, asyncio.Task[None]] = {}
        self.finished = 0  # choices whose engine request ended

    async def abort(self) -> None:
        for index, run in self.runs.items():
            if not run.done():
                await self.engine.abort(self.requests[index].engine_id)


class _Connection(Frames):
    """One frontend's jobs. A job ends when its last choice does (or the frontend closes it
    early); a frontend that goes away ends all of its jobs."""

    def __init__(self, channel: JobChannel) -> None:
        super().__init__()
        self.channel = channel
        self.pipeline = channel.pipeline
        self.jobs: dict[int, _ChannelJob] = {}
        # Admissions that wait (a grammar to compile, SGLang's pause): a close cancels its own.
        self.opening: dict[int, asyncio.Task[None]] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.channel.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.channel.connections.discard(self)
        for call in list(self.jobs):
            self._close(call)  # aborts what still runs

    def received(self, message: tuple[Any, ...]) -> None:
        kind, call = message[0], message[1]
        if kind == "open":
            self._open(call, message[2])
        elif kind == "abort":
            job = self.jobs.get(call)
            if job is not None:
                self._spawn(job.engine.abort(job.requests[message[2]].engine_id))
        elif kind == "stop":
            job = self.jobs.get(call)
            run = None if job is None else job.runs.get(message[2])
            if run is not None:
                run.cancel()
        elif kind == "close":
            self._close(call)
        elif kind == "hello":
            self._spawn(self._hello(call))
        elif kind == "model":
            try:
                self.pipeline.ready(message[2])
            except Exception as exc:
                self.send(("error", call, None, portable(exc)))
            else:
                self.send(("known", call))
        else:
            logger.error("job channel: unknown message %r", kind)

    def _spawn(self, work: Any) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _hello(self, call: int) -> None:
        pipeline = self.pipeline
        while pipeline.runtime is None and pipeline.load_error is None:
            await asyncio.sleep(_READY_POLL_S)
        if pipeline.runtime is None:
            self.send(("error", call, None, RuntimeError(pipeline.load_error)))
            return
        engine = pipeline.runtime.engine
        facts = EngineFacts(
            engine.model_name,
            engine.max_model_len,
            engine.vocab_size,
            tuple(engine.eos_token_ids),
            engine.dtype,
            frozenset(engine.features),
        )
        self.send(("facts", call, facts))

    def _open(self, call: int, spec: JobSpec) -> None:
        """Admit the job as ``pipeline.generate.start_job`` does in one process, and register
        it; the frontend already checked and rendered it, all but the adapter ``model`` names,
        which only the core knows (a 404 as one process answers). At once when nothing needs
        waiting for, as in one process."""
        if self.pipeline.control.gate.holding or any(c.grammar_text for c in spec.choices):
            self.opening[call] = self._spawn(self._open_later(call, spec))
            return
        try:
            self._admit(call, spec, [None] * len(spec.choices))
        except Exception as exc:
            self._refuse(call, exc)
            return
        self._start(call)

    async def _open_later(self, call: int, spec: JobSpec) -> None:
        pipeline = self.pipeline
        try:
            runtime = pipeline.ready()
            grammars = [await self._grammar(runtime.grammars, c) for c in spec.choices]
            gate = pipeline.control.gate
            if gate.holding:
                await gate.wait_while_held()
            self.opening.pop(call, None)
            self._admit(call, spec, grammars)
        except Exception as exc:
            self.opening.pop(call, None)
            self._refuse(call, exc)
            return
        self._start(call)

    def _admit(self, call: int, spec: JobSpec, grammars: list[Any]) -> None:
        pipeline = self.pipeline
        control = pipeline.control
        adapter = spec.adapter
        runtime = pipeline.ready(adapter if spec.adapter_param == "model" else None)
        job = _ChannelJob(spec.request_id, runtime.engine, spec.choices, grammars)
        job.version = control.admit_job(adapter, spec.adapter_param)
        self.jobs[call] = job
        pipeline.jobs.add(job)  # type: ignore[arg-type]

    def _start(self, call: int) -> None:
        """Run the admitted job's choices; "opened" leaves in the same write as what their
        first step sends (a non-streamed answer from a fast engine: all of it)."""
        job = self.jobs[call]
        for index in range(len(job.requests)):
            job.runs[index] = self._spawn(self._run(call, job, index))
        self.send(("opened", call))

    def _refuse(self, call: int, exc: Exception) -> None:
        self._close(call)
        self.send(("error", call, None, portable(exc)))

    @staticmethod
    async def _grammar(grammars: Any, spec: ChoiceSpec) -> Any:
        if spec.grammar_text is None:
            return None
        if grammars is None:
            raise InvalidRequest("structured outputs are not supported by this server's engine")
        try:
            return await grammars.compile_grammar(spec.grammar_text)
        except GrammarError as exc:
            raise InvalidRequest(str(exc)) from exc

    async def _run(self, call: int, job: _ChannelJob, index: int) -> None:
        spec = job.requests[index]
        sampling = spec.sampling
        if job.grammars[index] is not None:
            sampling = replace(sampling, grammar=job.grammars[index])
        stream = job.engine.generate(
            spec.engine_id,
            spec.prompt_ids,
            sampling,
            spec.media,
            cache_salt=spec.cache_salt,
            adapter=job.version,
            final_only=spec.final_only,
        )
        try:
            async with contextlib.aclosing(stream):
                async for output in stream:
                    self.send(("out", call, index, output))
                    if output.finish_reason is not None:
                        break
                    await self.drain()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.send(("error", call, index, portable(exc)))
        job.finished += 1
        if job.finished == len(job.requests) and self.jobs.get(call) is job:
            self._close(call)  # its last choice ended: the frontend sends no close

    def _close(self, call: int) -> None:
        opening = self.opening.pop(call, None)
        if opening is not None:
            opening.cancel()
        job = self.jobs.pop(call, None)
        if job is None:
            return
        self.pipeline.jobs.remove(job)  # type: ignore[arg-type]
        current = asyncio.current_task()
        runs = [run for run in job.runs.values() if not run.done() and run is not current]
        for run in runs:
            run.cancel()  # closing its stream aborts the engine request
        if job.version is not None:
            if runs:
                self._spawn(self._release_after(runs, job.version))
            else:
                self.pipeline.control.adapters.release(job.version)

    async def _release_after(self, runs: list[asyncio.Task[None]], version: AdapterVersion) -> None:
        """Release an adapter version once no request of the job is in the engine."""
        try:
            await asyncio.wait(runs)
        finally:
            self.pipeline.control.adapters.release(version)

    async def end(self) -> None:
        """The core is closing: end this frontend's jobs and its connection."""
        for call in list(self.jobs):
            self._close(call)
        if self.transport is not None:
            self.transport.close()
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
