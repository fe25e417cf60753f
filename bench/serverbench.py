"""Shared bits of the HTTP benchmarks: start a server process, load it, read its CPU time."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from tests.fake_engine import FakeEngine

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process, from /proc (the server's own cost, not the client's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def process_tree(pid: int) -> list[int]:
    """A process and its descendants (``--api-server-count`` serves from several), from /proc."""
    tree, pending = [], [pid]
    while pending:
        current = pending.pop()
        tree.append(current)
        children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        pending.extend(int(child) for child in children)
    return tree


def cpu_seconds_by_process(pid: int) -> dict[int, float]:
    """User + system CPU of a process and its descendants, each."""
    return {process: cpu_seconds(process) for process in process_tree(pid)}


class ServerProcess:
    def __init__(
        self,
        command: list[str],
        port: int,
        health_path: str = "/health",
        log: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        output = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - the child's
        self.process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + health_path, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.3)
        raise RuntimeError(f"{command} did not start")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=20)


def tokenwire_command(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "tokenwire.cli", "serve", "--port", str(port), *args]


def tree_env(tree: Path) -> dict[str, str]:
    """An environment whose Python imports ``tree``'s tokenwire and test fake engine (the
    installed package may be another checkout's), and these helpers; before any path the
    caller's environment adds (where a machine's carried packages are)."""
    inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    path = os.pathsep.join([str(tree / "src"), str(tree), str(HERE), *filter(None, inherited)])
    return {**os.environ, "PYTHONPATH": path}


def serve_fake_engine(
    port: int, make_engine: Callable[[Path], FakeEngine], *flags: str, model: str | None = None
) -> None:
    """Serve the real app (``tokenwire serve``'s, on its uvicorn protocol) over the project's fake
    engine, built by ``make_engine`` for a weightless view of ``model`` (default: the default
    model's); until killed. Sessions go to a temporary store unless ``flags`` name one."""
    import uvicorn

    from tests.fast_app import weightless_view
    from tokenwire.api.app import create_app
    from tokenwire.api.server import uvicorn_config
    from tokenwire.assets import prepare
    from tokenwire.settings import DEFAULT_MODEL, parse_serve_args

    with tempfile.TemporaryDirectory() as tmp:
        view = weightless_view(prepare(model or DEFAULT_MODEL), Path(tmp))
        argv = ["--model", str(view), "--port", str(port), "--log-level", "warning", *flags]
        if "--session-store" not in flags:
            argv += ["--session-store", str(Path(tmp) / "sessions.sqlite3")]
        settings = parse_serve_args(argv)
        app = create_app(settings, make_engine(view))
        uvicorn.Server(uvicorn_config(app, settings)).run()


@dataclass
class LoadResult:
    requests: int
    wall_s: float
    server_cpu_s: float

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s

    @property
    def cpu_us_per_request(self) -> float:
        return self.server_cpu_s / self.requests * 1e6


def run_load(
    url: str,
    pid: int,
    path: str,
    make_body: Callable[[int], bytes],
    *,
    clients: int,
    requests: int,
) -> LoadResult:
    """``clients`` concurrent keep-alive connections sending ``requests`` POSTs in all."""

    async def main() -> LoadResult:
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
            counter = iter(range(requests))
            headers = {"Content-Type": "application/json"}

            async def worker() -> None:
                for index in counter:
                    response = await client.post(path, content=make_body(index), headers=headers)
                    response.raise_for_status()

            # Warm up connections and caches, then measure.
            await asyncio.gather(
                *(client.post(path, content=make_body(0), headers=headers) for _ in range(clients))
            )
            cpu_before = cpu_seconds(pid)
            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(clients)))
            wall = time.perf_counter() - started
            return LoadResult(requests, wall, cpu_seconds(pid) - cpu_before)

    return asyncio.run(main())
