"""The pipeline's cost per output token over HTTP, above an engine that costs nothing.

The real app (tokenizer, template, decoder, job, dialects, middleware, uvicorn) serves SmolLM2's
tokenizer over ``InstantEngine``, which answers every request at once, one token per output with
``k`` alternatives: what is left is what the pipeline spends per token (job, choice state,
decoding, stop strings, logprob JSON, SSE). Each tree named by ``--tree`` (a checkout, e.g. the
branch point in a git worktree) is served the same way, and the trees are measured interleaved,
so their ratio holds on a loaded machine.

Usage: ``python bench/bench_pipeline_http.py [--tree OTHER_CHECKOUT] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson

HERE = Path(__file__).resolve().parent
TOKENS = 256
CLIENTS = 8
REQUESTS = 48
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


class InstantEngine:
    """The ``Engine`` protocol at no cost: token ids cycled from a fixed text, one per output."""

    model_name = "instant"
    weight_version = "default"
    dtype = "torch.float32"
    logprobs_mode = "raw_logprobs"

    def __init__(self, model_dir: Path, **_: Any) -> None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = 8192
        self.eos_token_ids = (2,)
        self.cycle = [504, 3575, 282, 4649, 314, 7042, 30, 198]  # "The capital of France is..."

    async def start(self) -> None: ...

    def is_ready(self) -> bool:
        return True

    def stats(self) -> Any:
        from tokenwire.engine.base import EngineStats

        return EngineStats(running=0, waiting=0, max_num_seqs=64)

    async def generate(
        self, request_id: str, prompt: list[int], sampling: Any, media: Any = None
    ) -> AsyncIterator[Any]:
        from tokenwire.engine.base import EngineOutput, TokenLogprob

        k = sampling.logprobs
        for position in range(sampling.max_tokens):
            token = self.cycle[position % len(self.cycle)]
            logprobs = None
            if k is not None:
                top = tuple((t, -0.1 * (r + 1)) for r, t in enumerate(range(100, 100 + k)))
                logprobs = [TokenLogprob(token, -0.5, 3, top)]
            last = position + 1 == sampling.max_tokens
            yield EngineOutput(
                [token],
                logprobs=logprobs,
                finish_reason="length" if last else None,
                num_prompt_tokens=len(prompt) if position == 0 else 0,
            )
            await asyncio.sleep(0)

    async def abort(self, request_id: str) -> bool:
        return False

    async def shutdown(self) -> None: ...

    def is_paused(self) -> bool:
        return False


def serve(port: int) -> None:
    """Run the app of the tokenwire on ``sys.path`` over ``InstantEngine``."""
    import uvicorn

    import tokenwire.api.app as app_module
    from tokenwire.settings import parse_serve_args

    app_module.create_engine = lambda kind, model_dir, **kw: InstantEngine(model_dir)
    settings = parse_serve_args(["--port", str(port), "--log-level", "warning"])
    uvicorn.run(app_module.create_app(settings), port=port, log_level="warning")


WORKLOADS: dict[str, tuple[str, dict[str, Any]]] = {
    "generate, top-5": (
        "/inference/v1/generate",
        {"token_ids": [1, 9690, 198], "sampling_params": {"max_tokens": TOKENS, "logprobs": 5}},
    ),
    "generate streamed": (
        "/inference/v1/generate",
        {"token_ids": [1, 9690, 198], "stream": True, "sampling_params": {"max_tokens": TOKENS}},
    ),
    "chat, top-5, stop string": (
        "/v1/chat/completions",
        {
            "messages": PARIS,
            "max_tokens": TOKENS,
            "logprobs": True,
            "top_logprobs": 5,
            "stop": ["\n\n\n"],
        },
    ),
    "chat streamed": (
        "/v1/chat/completions",
        {"messages": PARIS, "max_tokens": TOKENS, "stream": True},
    ),
}


class Server:
    def __init__(self, tree: Path) -> None:
        from serverbench import free_port

        self.tree = tree
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}:{HERE}"}
        command = [sys.executable, str(HERE / "bench_pipeline_http.py"), "--serve", str(self.port)]
        self.process = subprocess.Popen(command, env=env)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server of {tree} did not start")
            time.sleep(0.3)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=20)


async def load(url: str, path: str, body: dict[str, Any]) -> int:
    """``REQUESTS`` requests from ``CLIENTS`` clients; the output tokens they got."""
    payload = orjson.dumps(body)
    queue = list(range(REQUESTS))
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            queue.pop()
            response = await http.post(
                url + path, content=payload, headers={"content-type": "application/json"}
            )
            response.raise_for_status()
            tokens += TOKENS

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(client(http) for _ in range(CLIENTS)))
    return tokens


def measure(server: Server, path: str, body: dict[str, Any]) -> float:
    """Server CPU microseconds per output token."""
    from serverbench import cpu_seconds

    asyncio.run(load(server.url, path, body))  # warm-up
    before = cpu_seconds(server.process.pid)
    tokens = asyncio.run(load(server.url, path, body))
    return (cpu_seconds(server.process.pid) - before) / tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, help="another checkout to measure beside this one")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    trees = {"this tree": HERE.parent}
    if args.tree:
        trees["--tree"] = args.tree.resolve()
    servers = {name: Server(tree) for name, tree in trees.items()}
    try:
        results: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for workload, (path, body) in WORKLOADS.items():
                for name, server in servers.items():
                    cost = measure(server, path, body)
                    results.setdefault((workload, name), []).append(cost)
    finally:
        for server in servers.values():
            server.stop()
    print(
        f"server CPU µs per output token, median of {args.rounds} (load average "
        f"{os.getloadavg()[0]:.1f})"
    )
    for workload in WORKLOADS:
        row = {name: statistics.median(results[workload, name]) for name in trees}
        line = "  ".join(f"{name}: {value:7.1f}" for name, value in row.items())
        ratio = f"  ratio: {row['this tree'] / row['--tree']:.2f}x" if args.tree else ""
        print(f"{workload:28s} {line}{ratio}")


if __name__ == "__main__":
    main()
