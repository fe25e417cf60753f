"""The HTTP server process: uvicorn, with a graceful shutdown that ends every request cleanly.

On SIGTERM or SIGINT the server stops taking work (new requests get a JSON 503, /health says
so), lets running requests finish up to ``--shutdown-timeout``, then aborts the rest: they end
with ``finish_reason: "abort"`` and their tokens so far (streams with a final chunk and
``[DONE]``), and the process exits 0. A second signal stops it at once.
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from tokenwire.api.errors import error_body
from tokenwire.pipeline.context import Pipeline
from tokenwire.pipeline.jobs import JobRegistry

logger = logging.getLogger("tokenwire")

# After aborting, how long the aborted requests get to send their last bytes.
_ABORT_GRACE_S = 5.0
_POLL_S = 0.05


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, pipeline: Pipeline, shutdown_timeout_s: float):
        super().__init__(config)
        self.pipeline = pipeline
        self.shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A signal handler: only schedule the drain (the loop may be mid-step)."""
        if self._draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        logger.info(
            "shutting down: finishing requests in flight (up to %gs)", self.shutdown_timeout_s
        )
        self.pipeline.shutting_down = True  # new requests: 503
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        jobs = self.pipeline.jobs
        await _wait_until_empty(jobs, self.shutdown_timeout_s)
        if len(jobs):
            logger.warning("shutdown deadline reached: aborting %d request(s)", len(jobs))
            await jobs.abort(jobs.ids())
            await _wait_until_empty(jobs, _ABORT_GRACE_S)
        self.should_exit = True


async def _wait_until_empty(jobs: JobRegistry, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(jobs) and loop.time() < deadline:
        await asyncio.sleep(_POLL_S)


class JsonErrorHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP protocol, answering a malformed request with the JSON error body every
    other failure has (uvicorn writes text/plain)."""

    def send_400_response(self, msg: str) -> None:
        body = orjson.dumps(error_body(400, msg))
        head = [STATUS_LINE[400]]
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
