"""A request with a huge ``tools`` list: how long does it stall the event loop?

The real app on its uvicorn protocol serves the project's fake engine (``tests/fake_engine.py``)
for ``--model`` (qwen3-tiny: its template renders every tool into the prompt). One request with
``--mb`` MB of tools (``--tools`` function tools, each with a description and a parameters schema)
goes to each dialect's route (``/v1/chat/completions``, ``/v1/messages``, ``/v1/responses``) while
``/health`` is polled back to back on another connection; the worst ``/health`` latency while the
big request is in flight is the stall (the event loop answers nothing else meanwhile), against
the median ``/health`` latency with nothing else in flight, measured in the same run. ``--tree``
serves another checkout (e.g. the branch point) the same way after this one, for a before/after.

Usage: ``python bench/bench_big_tools.py [--mb 11] [--tools 10000] [--repeat 3] [--tree OTHER]
[--model M] [--smoke] [-- --server-flag ...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx
import orjson
from serverbench import ServerProcess, free_port, serve_fake_engine, tree_env

HERE = Path(__file__).resolve().parent
ROUTES = ("/v1/chat/completions", "/v1/messages", "/v1/responses")
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def serve(port: int, model: str, flags: list[str]) -> None:
    from tests.fake_engine import FakeEngine

    serve_fake_engine(port, FakeEngine.for_model, *flags, model=model)


def schema(index: int, size: int) -> dict[str, object]:
    """A function's parameters of about ``size`` bytes of JSON."""
    fields = max(1, size // 160)
    return {
        "type": "object",
        "properties": {
            f"field_{index}_{k}": {"type": "string", "description": "x" * 100}
            for k in range(fields)
        },
        "required": [f"field_{index}_0"],
    }


def body(route: str, tools: int, total_bytes: int) -> bytes:
    per_tool = max(200, total_bytes // tools - 100)
    specs = [
        (f"tool_{i}", f"Tool number {i}, which does a thing.", schema(i, per_tool))
        for i in range(tools)
    ]
    if route == "/v1/messages":
        listed = [{"name": n, "description": d, "input_schema": s} for n, d, s in specs]
        return orjson.dumps({"max_tokens": 8, "messages": MESSAGES, "tools": listed})
    if route == "/v1/responses":
        listed = [
            {"type": "function", "name": n, "description": d, "parameters": s} for n, d, s in specs
        ]
        return orjson.dumps({"max_output_tokens": 8, "input": "Hi", "tools": listed})
    listed = [
        {"type": "function", "function": {"name": n, "description": d, "parameters": s}}
        for n, d, s in specs
    ]
    return orjson.dumps({"max_tokens": 8, "messages": MESSAGES, "tools": listed})


async def measure(url: str, payload: bytes, route: str) -> tuple[int, float, float, int]:
    """(status, seconds the big request took, worst /health latency meanwhile, polls)."""
    async with (
        httpx.AsyncClient(base_url=url, timeout=300) as big,
        httpx.AsyncClient(base_url=url, timeout=300) as health,
    ):
        await health.get("/health")
        headers = {"Content-Type": "application/json"}
        started = time.perf_counter()
        task = asyncio.create_task(big.post(route, content=payload, headers=headers))
        worst, polls = 0.0, 0
        while not task.done():
            t0 = time.perf_counter()
            response = await health.get("/health")
            assert response.status_code == 200, response.text
            if not task.done():
                worst, polls = max(worst, time.perf_counter() - t0), polls + 1
        answer = task.result()
        return answer.status_code, time.perf_counter() - started, worst, polls


async def idle_health(url: str, count: int = 200) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        latencies = []
        for _ in range(count):
            t0 = time.perf_counter()
            (await client.get("/health")).raise_for_status()
            latencies.append(time.perf_counter() - t0)
        return statistics.median(latencies)


def run_tree(tree: Path, label: str, args: argparse.Namespace, flags: list[str]) -> None:
    port = free_port()
    command = [sys.executable, str(HERE / "bench_big_tools.py"), "--serve", str(port)]
    command += ["--model", args.model, "--", *flags]
    server = ServerProcess(command, port, env=tree_env(tree))
    try:
        idle = asyncio.run(idle_health(server.url))
        print(f"{label} ({tree}): idle /health median {idle * 1e3:.1f} ms")
        for route in ROUTES:
            payload = body(route, args.tools, int(args.mb * 1e6))
            runs = [asyncio.run(measure(server.url, payload, route)) for _ in range(args.repeat)]
            stalls = sorted(run[2] for run in runs)
            status = {run[0] for run in runs}
            took = statistics.median(run[1] for run in runs)
            print(
                f"  {route}: {len(payload) / 1e6:.1f} MB, {args.tools} tools -> {status}, "
                f"{took * 1e3:.0f} ms; worst /health meanwhile {stalls[len(stalls) // 2] * 1e3:.0f}"
                f" ms (median of {args.repeat}; max {stalls[-1] * 1e3:.0f} ms), "
                f"{stalls[len(stalls) // 2] / idle:.0f}x idle"
            )
            if any(run[0] >= 500 for run in runs):
                raise SystemExit(f"{route}: a 5xx answer")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=11.0)
    parser.add_argument("--tools", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tree", type=Path, help="another checkout to measure after this one")
    parser.add_argument("--model", default="qwen3-tiny", help="a template that renders tools")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args, flags = parser.parse_known_args()
    flags = [f for f in flags if f != "--"]
    if args.serve is not None:
        serve(args.serve, args.model, flags)
        return
    if args.smoke:
        args.mb, args.tools, args.repeat = 0.2, 200, 1
    run_tree(HERE.parent, "this tree", args, flags)
    if args.tree is not None:
        run_tree(args.tree.resolve(), "other tree", args, flags)


if __name__ == "__main__":
    main()
