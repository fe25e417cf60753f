"""The HTTP server process: uvicorn, with a graceful shutdown that ends every request cleanly.

On SIGTERM or SIGINT the server stops taking work: every request not yet in the engine (new,
held by SGLang's pause, or still rendering) gets a JSON 503, /health says so. Requests in the
engine finish up to ``--shutdown-timeout``, then the rest are aborted: they end with
``finish_reason: "abort"`` and their tokens so far (streams with a final chunk and ``[DONE]``).
What is still waiting then (a body that never arrives) is answered 503 too, and the process
exits 0, a few seconds after the timeout at most. A second signal stops it at once.

When the engine dies (the hf engine's thread, vLLM's engine core or a worker), the requests in
it fail with a 503 saying so, every new one gets the same, /health answers 503, and the process
exits 1 a few seconds later, as vLLM's server does: a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import resource
from types import FrameType
from typing import TYPE_CHECKING, Any

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from tokenwire.api.errors import error_body
from tokenwire.pipeline.context import Pipeline
from tokenwire.pipeline.jobs import JobRegistry

if TYPE_CHECKING:
    from tokenwire.settings import Settings

logger = logging.getLogger("tokenwire")

# After aborting, how long the aborted requests get to send their last bytes.
_ABORT_GRACE_S = 5.0
# Once the engine is done, how long answers already on their way get before the rest is 503.
_SETTLE_S = 1.0
_POLL_S = 0.05
# How often the server looks whether the engine died (vLLM's watchdog looks every 5 s).
_DEATH_POLL_S = 0.5


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, pipeline: Pipeline, shutdown_timeout_s: float):
        super().__init__(config)
        self.pipeline = pipeline
        self.shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task[None] | None = None
        self.exit_code = 0  # 1 once the engine died
        self.draining_by_signal = False

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        watch = self._loop.create_task(self._watch_engine())
        try:
            await super().serve(sockets)
        finally:
            watch.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A signal handler: only schedule the drain (the loop may be mid-step)."""
        if self._draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self.draining_by_signal = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        logger.info(
            "shutting down: finishing requests in flight (up to %gs)", self.shutdown_timeout_s
        )
        self.pipeline.shut_down()  # requests not yet in the engine: 503
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _watch_engine(self) -> None:
        """Exit 1 once the engine died. Its requests failed with it (503); answers on their way
        get a moment, what waits outside the engine is answered 503, then the server stops."""
        while (death := self.pipeline.engine_death) is None:
            await asyncio.sleep(_DEATH_POLL_S)
        self.exit_code = 1
        logger.error("the engine died (%s): answering what is in flight, then exiting 1", death)
        if self._draining:  # a signal's drain is under way and ends the server
            return
        self._draining = True
        self.pipeline.shut_down()  # requests held by SGLang's pause look again: 503
        await self._settle_requests()
        self.should_exit = True

    async def _drain(self) -> None:
        jobs = self.pipeline.jobs
        await _wait_until_empty(jobs, self.shutdown_timeout_s)
        if len(jobs):
            logger.warning("shutdown deadline reached: aborting %d request(s)", len(jobs))
            await jobs.abort(jobs.ids())
            await _wait_until_empty(jobs, _ABORT_GRACE_S)
        await self._settle_requests()
        self.should_exit = True

    async def _settle_requests(self) -> None:
        """Let the answers on their way go out, then cancel what is left (each answered 503)."""
        requests = [task for task in self.server_state.tasks if not task.done()]
        if requests:
            # The answers of jobs that just ended are on their way; what is left after that
            # never reached the engine (a body still arriving, a template or media fetch under
            # way): cancelled, each is answered 503 (``api.asgi``) now, not a text/plain 500
            # after uvicorn's own grace period.
            _, pending = await asyncio.wait(requests, timeout=_SETTLE_S)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=_ABORT_GRACE_S)


async def _wait_until_empty(jobs: JobRegistry, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(jobs) and loop.time() < deadline:
        await asyncio.sleep(_POLL_S)


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP protocol with the guards it lacks, each answered with the JSON error body
    every other failure has (uvicorn writes text/plain):

    - a malformed request: 400;
    - headers that do not arrive within ``header_timeout_s`` (of the connection opening or of
      a keep-alive request's first byte): 408 and closed, so idle or trickling connections
      cannot hold file descriptors for ever (uvicorn times out only idle keep-alive ones);
    - a connection past ``max_connections`` open at once: 503 and closed at once;
    - a client that reads nothing for ``send_timeout_s`` while output waits for it (the write
      buffer full): the connection is dropped, which ends its request as a disconnect does
      (its engine requests aborted); its waiting output is bounded by what that time makes.
    """

    def __init__(
        self,
        *args: Any,
        header_timeout_s: float,
        max_connections: int,
        send_timeout_s: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.send_timeout_s = send_timeout_s
        # The header deadline counts from the connection opening or a request's first byte
        # (None: no headers awaited). Its timer is not armed and cancelled per request (6 µs
        # each with uvloop): one stays armed, and when it fires early for the request now
        # awaited (armed for an earlier one) it is armed again for the rest of its time.
        self._headers_since: float | None = None
        self._header_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse(503, f"The server has {self.max_connections} connections open")
            return
        self._await_headers()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._headers_since is None:  # a keep-alive connection's next request
            self._await_headers()

    def on_headers_complete(self) -> None:
        self._headers_since = None
        super().on_headers_complete()
        self.cycle.transport = OneWriteHead(self.transport, self.loop)  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_send_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout_s, self._client_stalled)

    def resume_writing(self) -> None:
        self._cancel_send_timer()
        super().resume_writing()

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _client_stalled(self) -> None:
        self._send_timer = None
        logger.warning(
            "dropping a connection whose client read nothing for %gs", self.send_timeout_s
        )
        # abort, not close: close waits to flush the buffer this client never reads.
        self.transport.abort()

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, msg)

    def _await_headers(self) -> None:
        self._headers_since = self.loop.time()
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_header_timer(self) -> None:
        self._headers_since = None
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        since = self._headers_since
        if since is None:
            return  # no headers awaited: the next request arms the timer again
        left = since + self.header_timeout_s - self.loop.time()
        if left > 0:
            self._header_timer = self.loop.call_later(left, self._headers_late)
            return
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request: an answer now would cut into the one being sent. The
            # connection closes once that one is done.
            self.cycle.keep_alive = False
            return
        message = f"The request headers did not arrive within {self.header_timeout_s:g} s"
        self._refuse(408, message)

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with the JSON error body and close the connection."""
        self._cancel_header_timer()
        body = orjson.dumps(error_body(status, message))
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head.extend([name, b": ", value, b"\r\n"])
        head.extend(
            [
                b"content-type: application/json\r\n",
                b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                b"connection: close\r\n\r\n",
                body,
            ]
        )
        self.transport.write(b"".join(head))
        self.transport.close()


class OneWriteHead:
    """A response's view of its connection: its head (uvicorn writes it as soon as the
    response starts) is held until the body's first bytes and leaves with them in one write,
    one system call instead of two per response. A head whose body does not follow in the
    same step of the request's task (a stream whose first chunk comes later) leaves at the end
    of that step."""

    __slots__ = ("_held", "_loop", "_started", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._started = False
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._held is not None:
            data, self._held = self._held + data, None
        elif not self._started:  # the first write: the head (or a 100 Continue before it)
            self._started = True
            self._held = data
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def flush(self) -> None:
        if self._held is not None:
            data, self._held = self._held, None
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()


# File descriptors kept back from connections: model shards, template workers, media, logs.
_RESERVED_FDS = 256
_TARGET_OPEN_FILES = 65536  # as vLLM raises it at start-up


def connection_cap(requested: int | None) -> int:
    """``--max-connections``, or what the open-file limit allows (raised to its hard limit
    first, as vLLM does) less a reserve: connections must run out before file descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = _TARGET_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, _TARGET_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    if requested is not None:
        return requested
    limit = _TARGET_OPEN_FILES if soft == resource.RLIM_INFINITY else soft
    return max(limit - _RESERVED_FDS, 16)


def uvicorn_config(app: Any, settings: Settings, uds: str | None = None) -> uvicorn.Config:
    """How ``tokenwire serve`` runs ``app`` under uvicorn (tests build the same); ``uds``: on
    that Unix socket instead of ``--host``/``--port`` (``api.api_servers``' core)."""
    protocol = functools.partial(
        HttpProtocol,
        header_timeout_s=settings.header_read_timeout_s,
        max_connections=connection_cap(settings.max_connections),
        send_timeout_s=settings.send_timeout_s,
    )
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        uds=uds,
        log_level=settings.log_level,
        loop="uvloop",
        http=protocol,  # type: ignore[arg-type]
        access_log=False,
        timeout_graceful_shutdown=5,
    )
