"""Shared bits of the HTTP benchmarks: start a server process, load it, read its CPU time."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process, from /proc (the server's own cost, not the client's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


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
