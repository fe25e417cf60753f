"""Frontend CPU of requests idle on the engine: what waiting costs, per in-flight request-second.

A rollout step sends ~1,000 requests that then wait on the engine; the frontend should spend
nothing on them meanwhile. The real app on its uvicorn protocol serves the project's fake engine
(``tests/fake_engine.py``), which holds every request until it is aborted; ``--requests`` requests
(non-streamed, then streamed) are sent at once, and once all are in the engine the server
process's CPU is read from /proc over ``--seconds``. Then one /abort_requests ends them all: each
must answer 200 (an error exits 1). ``--tree`` serves another checkout (e.g. the branch point in a
git worktree) the same way, one after the other, for the before/after of a change.

Usage: ``python bench/bench_frontend_idle.py [--requests 1024] [--seconds 10] [--tree OTHER]
[--smoke]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import httpx
import orjson
from serverbench import ServerProcess, cpu_seconds, free_port, serve_fake_engine, tree_env

HERE = Path(__file__).resolve().parent


def serve(port: int) -> None:
    """The server child: the fake engine with every request held at its first output."""
    import itertools

    from tests.fake_engine import EngineCall, FakeEngine, Gate, Step

    class HeldEngine(FakeEngine):
        """The fake engine, its held requests released by their abort. The fake polls its gates
        every 2 ms (tests open them from another thread): ~1,000 held requests would cost more
        CPU than the frontend being measured, so this one waits on an event instead."""

        def __init__(self, **kwargs: object) -> None:
            super().__init__(**kwargs)  # type: ignore[arg-type]
            self.released: dict[str, asyncio.Event] = {}

        async def _hold(self, call: EngineCall, gates: list[Gate]) -> None:
            if gates:
                event = self.released.setdefault(call.request_id, asyncio.Event())
                try:
                    await event.wait()
                finally:
                    del self.released[call.request_id]

        async def abort(self, request_id: str) -> bool:
            found = await super().abort(request_id)
            if request_id in self.released:
                self.released[request_id].set()
            return found

    def make_engine(view: Path) -> FakeEngine:
        engine = HeldEngine.for_model(view)
        engine.script = lambda *_: itertools.chain([Step(5, gate=Gate())], itertools.repeat(6))
        return engine

    serve_fake_engine(port, make_engine)


def engine_running(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("tokenwire_engine_running_requests "):
            return float(line.split()[1])
    raise RuntimeError("no tokenwire_engine_running_requests in /metrics")


async def held_round(url: str, pid: int, requests: int, seconds: float, stream: bool) -> float:
    """Server CPU seconds per in-flight request-second while ``requests`` wait on the engine."""
    body = orjson.dumps({"token_ids": [1, 2, 3], "stream": stream, "sampling_params": {}})
    headers = {"content-type": "application/json"}
    limits = httpx.Limits(max_connections=requests + 1, max_keepalive_connections=requests + 1)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:

        async def one() -> int:
            response = await client.post("/inference/v1/generate", content=body, headers=headers)
            if response.status_code == 200 and stream and b'"abort"' not in response.content:
                return -1  # a stream that failed in-band
            return response.status_code

        sent = [asyncio.create_task(one()) for _ in range(requests)]
        with httpx.Client(base_url=url, timeout=60) as control:
            deadline = time.monotonic() + 300
            while await asyncio.to_thread(engine_running, control) < requests:
                if time.monotonic() > deadline or any(task.done() for task in sent):
                    raise RuntimeError("the requests did not all reach the engine")
                await asyncio.sleep(0.2)
            await asyncio.sleep(0.5)  # let the last arrivals settle
            before = cpu_seconds(pid)
            await asyncio.sleep(seconds)
            spent = cpu_seconds(pid) - before
            control.post("/abort_requests", json={}).raise_for_status()
        statuses = await asyncio.gather(*sent)
    failed = [status for status in statuses if status != 200]
    if failed:
        raise RuntimeError(f"{len(failed)} of {requests} requests failed: {sorted(set(failed))}")
    return spent / (requests * seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--tree", type=Path, help="another checkout, measured after this one")
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    if args.smoke:
        args.requests, args.seconds = 8, 0.5
    trees = {"this tree": HERE.parent}
    if args.tree:
        trees["--tree"] = args.tree.resolve()
    print(
        f"{args.requests} requests held on the engine for {args.seconds:g} s; server CPU per "
        f"in-flight request-second, and the share of a core they cost (load average "
        f"{os.getloadavg()[0]:.1f})"
    )
    for name, tree in trees.items():
        port = free_port()
        command = [sys.executable, str(HERE / "bench_frontend_idle.py"), "--serve", str(port)]
        server = ServerProcess(command, port, env=tree_env(tree))
        try:
            for stream in (False, True):
                per = asyncio.run(
                    held_round(server.url, server.process.pid, args.requests, args.seconds, stream)
                )
                kind = "streamed" if stream else "non-streamed"
                print(
                    f"{name:10s} {kind:13s} {per * 1e3:8.4f} ms CPU per request-second  "
                    f"{per * args.requests * 100:6.2f}% of a core for {args.requests}"
                )
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
