"""The collector after start-up, per endpoint: tokenwire as shipped (start-up heap frozen, larger
collection thresholds: ``api/app.py``) against the same server with Python's default collector.

Both servers (qwen3-tiny) run side by side and take turns, one client sending requests one at a
time; the number is the server's CPU per request from /proc (the client shares the machine),
median over rounds. Requests: /tokenize of a short prompt, /v1/chat/completions/render of
bench_render's conversation (system + 10 messages, 3 tools), /inference/v1/generate of its
first 16 ids with ``max_tokens`` 1 (the frontend around one small engine step; torch on one
thread), and /v1/completions/derender of
32,768 ids with top-5 logprobs (19 MB). ``--thresholds A,B,C`` adds a frozen-heap server with
other thresholds, for tuning.

Run: ``python bench/bench_gc.py [--rounds R] [--thresholds 700,10,10 ...]``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).parent))

from bench_derender import mixed_text
from bench_derender_http import Client, choice, generate_logprobs
from bench_render import MESSAGES, TOOLS
from serverbench import ServerProcess, cpu_seconds, free_port

from tokenwire.assets import prepare

SERVE = ["serve", "--model", "qwen3-tiny", "--max-model-len", "32768"]


def server_command(port: int, thresholds: tuple[int, ...] | str | None) -> list[str]:
    """tokenwire serve; ``None``: Python's default collector; a tuple: other thresholds."""
    if thresholds == "shipped":
        patch = ""
    elif thresholds is None:
        patch = "app._settle_heap = lambda: None; "
    else:
        patch = f"app.GC_THRESHOLDS = {tuple(thresholds)!r}; "
    code = (
        f"import sys, tokenwire.api.app as app; {patch}"
        "from tokenwire.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    return [sys.executable, "-c", code, *SERVE, "--port", str(port)]


def requests(client: Client, scale: float) -> dict[str, tuple[str, bytes, int]]:
    """Name -> (path, body, requests per round); ``scale`` shrinks the counts and the
    derender body."""
    rendered = orjson.loads(
        client.post(
            "/v1/chat/completions/render",
            orjson.dumps({"messages": MESSAGES, "tools": TOOLS, "max_tokens": 1}),
        )[0]
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepare("qwen3-tiny"))
    size = max(int(32768 * scale), 64)
    text = mixed_text(random.Random(1234), size * 5)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:size]
    logprobs = generate_logprobs(ids, len(tokenizer), 5)
    response = {"request_id": "b", "choices": [choice(ids, logprobs, "length")]}
    return {
        "/tokenize": (
            "/tokenize",
            orjson.dumps({"prompt": "Reinforcement learning from token ids."}),
            max(int(1000 * scale), 1),
        ),
        "chat render": (
            "/v1/chat/completions/render",
            orjson.dumps({"messages": MESSAGES, "tools": TOOLS, "max_tokens": 1}),
            max(int(200 * scale), 1),
        ),
        "generate, 16 + 1 tokens": (
            "/inference/v1/generate",
            orjson.dumps(
                {
                    "token_ids": rendered["token_ids"][:16],
                    "sampling_params": {"max_tokens": 1, "temperature": 0},
                }
            ),
            max(int(100 * scale), 1),
        ),
        "derender 32k x top 5": (
            "/v1/completions/derender",
            orjson.dumps({"generate_responses": [response]}),
            3,
        ),
    }


def per_request_cpu(client: Client, pid: int, path: str, body: bytes, count: int) -> float:
    before = cpu_seconds(pid)
    for _ in range(count):
        client.post(path, body)
    return (cpu_seconds(pid) - before) / count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--thresholds", action="append", default=[])
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    scale = 0.01 if args.smoke else 1.0
    if args.smoke:
        args.rounds = 1
    variants: dict[str, tuple[int, ...] | str | None] = {
        "shipped": "shipped",
        "Python default": None,
    }
    for spec in args.thresholds:
        variants[f"frozen, {spec}"] = tuple(int(part) for part in spec.split(","))

    # One torch thread: idle intra-op threads spin after each engine step, and that CPU (which
    # varies 4x between identical runs) would drown the frontend's.
    os.environ["OMP_NUM_THREADS"] = "1"
    servers: dict[str, ServerProcess] = {}
    try:
        for name, thresholds in variants.items():
            port = free_port()
            servers[name] = ServerProcess(server_command(port, thresholds), port)
        clients = {name: Client(server.url) for name, server in servers.items()}
        bodies = requests(next(iter(clients.values())), scale)
        for client in clients.values():  # warm-up
            for path, body, _ in bodies.values():
                client.post(path, body)
        samples: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for kind, (path, body, count) in bodies.items():
                for name, client in clients.items():
                    pid = servers[name].process.pid
                    cpu = per_request_cpu(client, pid, path, body, count)
                    samples.setdefault((kind, name), []).append(cpu)
    finally:
        for server in servers.values():
            server.stop()

    load = os.getloadavg()
    med: Callable[[list[float]], float] = statistics.median
    print(
        f"server CPU per request, median of {args.rounds} rounds; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n"
    )
    names = list(variants)
    print("| request | " + " | ".join(f"{name} µs" for name in names) + " | shipped / default |")
    print("| --- |" + " ---: |" * (len(names) + 1))
    for kind in bodies:
        values = [med(samples[(kind, name)]) * 1e6 for name in names]
        cells = " | ".join(f"{value:,.0f}" for value in values)
        # A smoke run's CPU time can be below /proc's 10 ms tick (0).
        ratio = f"{values[0] / values[1]:.2f}x" if values[1] else "n/a"
        print(f"| {kind} | {cells} | {ratio} |")


if __name__ == "__main__":
    main()
