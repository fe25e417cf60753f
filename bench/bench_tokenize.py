"""/tokenize overhead: tokenwire against a bare endpoint that only calls the tokenizer.

32 concurrent clients send a ~20-token prompt; the number that matters is the server's CPU per
request (from /proc), since the client shares the machine. Target: at most 1.25x the bare one.

Run: ``python bench/bench_tokenize.py [--requests N]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).parent))

from serverbench import LoadResult, ServerProcess, free_port, run_load, tokenwire_command

from tokenwire.assets import prepare

PROMPT = "Reinforcement learning from token ids keeps the sampler and the trainer in agreement."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.clients = 32, 4
    model_dir = prepare("qwen3-tiny")

    def body(index: int) -> bytes:
        return orjson.dumps({"prompt": f"{PROMPT} {index}"})

    def measure(label: str, command: list[str], port: int) -> tuple[str, LoadResult]:
        server = ServerProcess(command, port)
        try:
            return label, run_load(
                server.url,
                server.process.pid,
                "/tokenize",
                body,
                clients=args.clients,
                requests=args.requests,
            )
        finally:
            server.stop()

    bare_app = str(Path(__file__).parent / "bare_tokenize_app.py")
    rows = []
    for kind, label in (
        ("raw", "bare ASGI + tokenizer"),
        ("fastapi", "bare FastAPI route + tokenizer"),
    ):
        port = free_port()
        rows.append(
            measure(label, [sys.executable, bare_app, str(model_dir), str(port), kind], port)
        )
    port = free_port()
    rows.append(
        measure("tokenwire /tokenize", tokenwire_command(port, "--model", "qwen3-tiny"), port)
    )

    from tokenizers import Tokenizer

    tokens = len(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(f"{PROMPT} 0").ids)
    base = rows[0][1].cpu_us_per_request
    print(
        f"/tokenize, {args.clients} concurrent clients, {args.requests} requests, "
        f"a prompt of {tokens} tokens\n"
    )
    framework = rows[1][1].cpu_us_per_request
    print("| server | requests/s | server CPU µs/request | vs bare ASGI | vs bare FastAPI |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, result in rows:
        cpu = result.cpu_us_per_request
        print(
            f"| {name} | {result.requests_per_s:,.0f} | {cpu:,.0f} | {cpu / base:.2f}x | "
            f"{cpu / framework:.2f}x |"
        )


if __name__ == "__main__":
    main()
