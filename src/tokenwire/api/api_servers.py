"""``--api-server-count N``: N frontend processes on one port, sharing one core process.

The core is the whole server as one process runs it (engine, control plane, jobs, sessions,
remembered prompts, metrics), listening on a Unix socket in a private directory, plus the job
channel (``pipeline.core_channel``). Each frontend loads the text side of the model (tokenizer,
chat template, media processing), accepts connections on the shared port, answers the routes
whose work is per request (``api.forward.FRONTEND_PATHS``) itself, with their jobs run in the
core, and forwards every other request to the core. So every state has one owner, the core,
and the per-request text work, the larger part of a small request's CPU, spreads over N cores.

This process only starts them and watches: a signal goes on to all of them (each drains as one
server does); when one ends on its own (the core's engine died, a frontend crashed) the others
are stopped and the exit code is 1, for a supervisor to restart the server. Each child leads a
process group, ended once the child ended: what a killed core left (vLLM's engine core under it)
goes with it. If this process is killed outright, its children get SIGTERM from the kernel (as
vLLM's do), so none goes on holding the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:
    import socket
    from collections.abc import Callable

    from tokenwire.engine.base import Engine
    from tokenwire.settings import Settings

logger = logging.getLogger("tokenwire")

CORE_HTTP_SOCKET = "core-http.sock"
CORE_JOBS_SOCKET = "core-jobs.sock"
_STOP_GRACE_S = 30.0  # past --shutdown-timeout, before a child that will not stop is killed
_PR_SET_PDEATHSIG = 1


def serve_api_servers(settings: Settings, make_engine: Callable[[], Engine] | None = None) -> int:
    """Run the core and ``settings.api_server_count`` frontends until a signal or a death.
    ``make_engine`` (picklable: the core is a fresh interpreter) builds the core's engine in
    place of the one ``--engine`` names, as ``create_app``'s ``engine`` does (benches)."""
    directory = Path(tempfile.mkdtemp(prefix="tokenwire-"))  # 0700: only this user's processes
    # Each process counts its requests in a file of its own here; /metrics sums them.
    (directory / "metrics").mkdir()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory / "metrics")
    listener = uvicorn.Config(app=None, host=settings.host, port=settings.port).bind_socket()
    spawn = multiprocessing.get_context("spawn")
    core = spawn.Process(
        target=_run_core, args=(settings, directory, make_engine), name="tokenwire-core"
    )
    frontends = [
        spawn.Process(
            target=_run_frontend,
            args=(settings, directory, listener),
            name=f"tokenwire-frontend-{index}",
        )
        for index in range(settings.api_server_count)
    ]
    children: list[BaseProcess] = [core, *frontends]
    stopping = False

    def stop(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.pid is not None and child.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for child in children:
            child.start()
        listener.close()  # the frontends hold it now
        logger.info(
            "serving on http://%s:%d with %d API server processes and one core",
            settings.host,
            settings.port,
            len(frontends),
        )
        first = wait([child.sentinel for child in children])
        if not stopping:
            ended = next(child for child in children if child.sentinel in first)
            logger.error("%s exited (%s): stopping the others", ended.name, ended.exitcode)
            stop(signal.SIGTERM, None)
        for child in children:
            child.join(settings.shutdown_timeout_s + _STOP_GRACE_S)
            if child.exitcode is None:
                child.kill()
                child.join()
            # What a child started and left behind, were it killed (vLLM's engine core under
            # the core, request-template workers): its process group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        shutil.rmtree(directory, ignore_errors=True)
    if stopping and core.exitcode == 0 and all(child.exitcode == 0 for child in frontends):
        return 0
    return 1


def _run_core(
    settings: Settings, directory: Path, make_engine: Callable[[], Engine] | None
) -> None:
    from tokenwire.api.app import create_app
    from tokenwire.api.server import GracefulServer, uvicorn_config
    from tokenwire.pipeline.core_channel import JobChannel

    _as_child()
    _log(settings)
    app = create_app(settings, None if make_engine is None else make_engine())
    pipeline = app.state.pipeline
    config = uvicorn_config(app, settings, uds=str(directory / CORE_HTTP_SOCKET))
    server = GracefulServer(config, pipeline, settings.shutdown_timeout_s)

    async def serve() -> None:
        channel = JobChannel(pipeline)
        await channel.start(str(directory / CORE_JOBS_SOCKET))
        try:
            await server.serve()
        finally:
            await channel.close()

    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(serve())
    raise SystemExit(server.exit_code)


def _run_frontend(settings: Settings, directory: Path, listener: socket.socket) -> None:
    from tokenwire.api.app import create_app
    from tokenwire.api.forward import ForwardToCore
    from tokenwire.api.server import GracefulServer, uvicorn_config
    from tokenwire.pipeline.core_link import CoreLink

    _as_child()
    _log(settings)
    link = CoreLink(str(directory / CORE_JOBS_SOCKET))
    app = create_app(settings, core=link)
    pipeline = app.state.pipeline
    front = ForwardToCore(app, pipeline, str(directory / CORE_HTTP_SOCKET))
    server = GracefulServer(uvicorn_config(front, settings), pipeline, settings.shutdown_timeout_s)
    server.run(sockets=[listener])
    # The core ends first in a shutdown, which this frontend sees as its engine's death.
    raise SystemExit(0 if server.draining_by_signal else server.exit_code)


def _as_child() -> None:
    """Lead a process group of its own, which the parent ends once this process ended, with
    whatever it started; and get SIGTERM when the parent dies (Linux's PR_SET_PDEATHSIG)."""
    os.setpgrp()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before the call
        os.kill(os.getpid(), signal.SIGTERM)


def _log(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper() if settings.log_level != "trace" else "DEBUG",
        format=f"%(asctime)s %(levelname)s %(name)s [{os.getpid()}]: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per forwarded request
