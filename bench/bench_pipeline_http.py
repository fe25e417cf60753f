"""The pipeline's cost per output token over HTTP, above an engine that costs next to nothing.

The real app (tokenizer, template, decoder, job, dialects, middleware, uvicorn) serves SmolLM2's
tokenizer over the project's fake engine (``tests/fake_engine.py``), scripted to answer every
request at once, one token per output with the alternatives it makes up: what is left is what
the pipeline spends per token (job, choice state, decoding, stop strings, logprob JSON, SSE).
Each tree named by ``--tree`` (a checkout, e.g. the branch point in a git worktree) is served the
same way, its own fake engine included, and the trees are measured interleaved, so their ratio
holds on a loaded machine. A request that fails (an error status, an error event in a stream)
exits 1.

Usage: ``python bench/bench_pipeline_http.py [--tree OTHER_CHECKOUT] [--rounds 3] [--smoke]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
from serverbench import ServerProcess, cpu_seconds, free_port, serve_fake_engine, tree_env

HERE = Path(__file__).resolve().parent
TOKENS = 256
CLIENTS = 8
REQUESTS = 48
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
CYCLE = [504, 3575, 282, 4649, 314, 7042, 30, 198]  # "The capital of France is..."


def serve(port: int) -> None:
    """Serve the tokenwire on ``sys.path`` over its fake engine, cycling ``CYCLE``."""
    import itertools

    from tests.fake_engine import FakeEngine

    def make_engine(view: Path) -> FakeEngine:
        engine = FakeEngine.for_model(view)
        engine.script = lambda *_: itertools.cycle(CYCLE)
        return engine

    serve_fake_engine(port, make_engine)


def workloads(tokens: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """Name -> (path, body), each request ``tokens`` output tokens long."""
    return {
        "generate, top-5": (
            "/inference/v1/generate",
            {"token_ids": [1, 9690, 198], "sampling_params": {"max_tokens": tokens, "logprobs": 5}},
        ),
        "generate streamed": (
            "/inference/v1/generate",
            {
                "token_ids": [1, 9690, 198],
                "stream": True,
                "sampling_params": {"max_tokens": tokens},
            },
        ),
        "chat, top-5, stop string": (
            "/v1/chat/completions",
            {
                "messages": PARIS,
                "max_tokens": tokens,
                "logprobs": True,
                "top_logprobs": 5,
                "stop": ["\n\n\n"],
            },
        ),
        "chat streamed": (
            "/v1/chat/completions",
            {"messages": PARIS, "max_tokens": tokens, "stream": True},
        ),
    }


def start_server(tree: Path) -> ServerProcess:
    port = free_port()
    command = [sys.executable, str(HERE / "bench_pipeline_http.py"), "--serve", str(port)]
    return ServerProcess(command, port, env=tree_env(tree))


async def load(url: str, path: str, body: dict[str, Any], requests: int, tokens: int) -> int:
    """``requests`` requests of ``tokens`` tokens from ``CLIENTS`` clients; the tokens got."""
    payload = orjson.dumps(body)
    queue = list(range(requests))
    got = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal got
        while queue:
            queue.pop()
            response = await http.post(
                url + path, content=payload, headers={"content-type": "application/json"}
            )
            response.raise_for_status()
            if body.get("stream") and b'"error"' in response.content:
                raise RuntimeError(f"{path} streamed an error: {response.text[-300:]}")
            got += tokens

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(client(http) for _ in range(CLIENTS)))
    return got


def measure(
    server: ServerProcess, path: str, body: dict[str, Any], requests: int, tokens: int
) -> float:
    """Server CPU microseconds per output token."""
    asyncio.run(load(server.url, path, body, CLIENTS, tokens))  # warm-up
    before = cpu_seconds(server.process.pid)
    got = asyncio.run(load(server.url, path, body, requests, tokens))
    return (cpu_seconds(server.process.pid) - before) / got * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, help="another checkout to measure beside this one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    requests, tokens = (CLIENTS, 8) if args.smoke else (REQUESTS, TOKENS)
    if args.smoke:
        args.rounds = 1
    trees = {"this tree": HERE.parent}
    if args.tree:
        trees["--tree"] = args.tree.resolve()
    runs = workloads(tokens)
    servers = {name: start_server(tree) for name, tree in trees.items()}
    try:
        results: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for workload, (path, body) in runs.items():
                for name, server in servers.items():
                    cost = measure(server, path, body, requests, tokens)
                    results.setdefault((workload, name), []).append(cost)
    finally:
        for server in servers.values():
            server.stop()
    print(
        f"server CPU µs per output token, median of {args.rounds} (load average "
        f"{os.getloadavg()[0]:.1f})"
    )
    for workload in runs:
        row = {name: statistics.median(results[workload, name]) for name in trees}
        line = "  ".join(f"{name}: {value:7.1f}" for name, value in row.items())
        ratio = f"  ratio: {row['this tree'] / row['--tree']:.2f}x" if args.tree else ""
        print(f"{workload:28s} {line}{ratio}")


if __name__ == "__main__":
    main()
