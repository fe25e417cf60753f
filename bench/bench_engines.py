"""The hf engine against vLLM's CPU engine, over HTTP, on the same workloads (issue 23).

Servers (one at a time, so none shares the cores with another), SmolLM2-135M in float32:
- ``tw-hf``: ``tokenwire serve`` (its embedded hf engine);
- ``tw-vllm``: ``tokenwire serve --engine vllm --enforce-eager`` under ``--vllm-python`` (the
  .venv-vllm interpreter, with this tree's ``src`` first on its path), when given.
Workloads, all greedy with ``ignore_eos`` on /inference/v1/generate:
- ``1x128``: one request of 128 tokens; ``32x128`` and ``64x128``: that many at once;
- ``grpo``: 8 prompts of 512 random ids, n=8, 64 tokens each, all at once;
- ``multi-turn``: 8 conversations of 4 turns (each turn: the last prompt + its output + a new
  user message, 32 tokens).
For each: wall output tokens/s and server CPU seconds per output token (the server's whole
process tree from /proc: vLLM's engine core is a child process). CPU per token holds under load;
wall time does not. The limit: an in-process static ``model.generate`` batch of the 32 prompts
(left-padded, 128 new tokens) on as many torch threads as the hf engine's, its own CPU per token
measured the same way.

Usage: ``python bench/bench_engines.py [--vllm-python .venv-vllm/bin/python] [--only 32x128]
[--src OTHER_TREE/src]`` (``--src``: serve another tree, e.g. a branch point, to compare).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serverbench import CLOCK_TICKS, ServerProcess, free_port

from tokenwire.assets import prepare
from tokenwire.engine.defaults import default_engine_threads

MODEL = "smollm2-135m-instruct"
SRC = Path(__file__).resolve().parent.parent / "src"
TOPICS = ["the ocean", "bread", "a night train", "prime numbers", "owls", "glass", "tea", "jazz"]


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its live descendants, from /proc."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def chat_prompts(model_dir: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for i in range(count):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write about {TOPICS[i % 8]} (take {i})."}],
            add_generation_prompt=True,
        )
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return prompts


async def generate(client: httpx.AsyncClient, ids: list[int], tokens: int, n: int = 1) -> Any:
    body = {
        "token_ids": ids,
        "sampling_params": {"max_tokens": tokens, "temperature": 0, "ignore_eos": True, "n": n},
    }
    response = await client.post("/inference/v1/generate", json=body)
    response.raise_for_status()
    return response.json()["choices"]


def output_tokens(choices: list[Any]) -> int:
    return sum(len(c["token_ids"]) for c in choices)


Workload = Callable[[httpx.AsyncClient], Awaitable[int]]


def workloads(prompts: list[list[int]], tokens: int = 128) -> dict[str, Workload]:
    """The workloads by name, their requests ``tokens`` long (GRPO's half, a turn's a quarter)."""
    rng = random.Random(0)
    grpo_prompts = [[rng.randrange(100, 40000) for _ in range(512)] for _ in range(8)]
    user_turn = prompts[0][-24:]  # a user message's worth of ids, appended each turn

    async def concurrent(client: httpx.AsyncClient, count: int) -> int:
        done = await asyncio.gather(*(generate(client, prompts[i], tokens) for i in range(count)))
        return sum(map(output_tokens, done))

    async def grpo(client: httpx.AsyncClient) -> int:
        done = await asyncio.gather(*(generate(client, p, tokens // 2, n=8) for p in grpo_prompts))
        return sum(map(output_tokens, done))

    async def multi_turn(client: httpx.AsyncClient) -> int:
        async def conversation(prompt: list[int]) -> int:
            total = 0
            for _ in range(4):
                choices = await generate(client, prompt, tokens // 4)
                total += output_tokens(choices)
                prompt = prompt + choices[0]["token_ids"] + user_turn
            return total

        return sum(await asyncio.gather(*(conversation(prompts[i]) for i in range(8))))

    return {
        "1x128": lambda c: concurrent(c, 1),
        "32x128": lambda c: concurrent(c, 32),
        "64x128": lambda c: concurrent(c, 64),
        "grpo": grpo,
        "multi-turn": multi_turn,
    }


def measure_server(
    command: list[str], port: int, env: dict[str, str], chosen: dict[str, Workload]
) -> dict[str, tuple[float, float]]:
    """(tokens/s, server CPU s per token) per workload, after one warm-up request."""
    server = ServerProcess(command, port, env=env)
    results = {}
    try:

        async def main() -> None:
            limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
            async with httpx.AsyncClient(
                base_url=server.url, limits=limits, timeout=3600
            ) as client:
                await generate(client, [1, 2, 3], 8)
                for name, work in chosen.items():
                    cpu = tree_cpu_seconds(server.process.pid)
                    began = time.perf_counter()
                    tokens = await work(client)
                    wall = time.perf_counter() - began
                    spent = tree_cpu_seconds(server.process.pid) - cpu
                    results[name] = (tokens / wall, spent / tokens)
                    rate, cost = tokens / wall, spent / tokens * 1000
                    print(f"  {name}: {rate:.1f} tok/s, {cost:.1f} ms CPU/token")

        asyncio.run(main())
    finally:
        server.stop()
    return results


def static_batch(model_dir: Path, prompts: list[list[int]]) -> tuple[float, float]:
    """One left-padded ``model.generate`` batch of ``prompts``, 128 new tokens each."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(default_engine_threads())  # as many as the hf engine's forwards
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    cpu, began = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=128,
            min_new_tokens=128,
            do_sample=False,
            pad_token_id=0,
        )
    wall, spent = time.perf_counter() - began, time.process_time() - cpu
    tokens = (out.shape[1] - width) * len(prompts)
    return tokens / wall, spent / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vllm-python", type=Path, help="the .venv-vllm interpreter")
    parser.add_argument("--only", help="comma-separated workloads (default: all)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-limit", action="store_true", help="no static batch")
    parser.add_argument("--src", type=Path, default=SRC, help="the tree the servers run")
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.smoke:  # one request of 8 tokens per server, no static batch
        args.only, args.skip_limit = "1x128", True
    model_dir = Path(prepare(MODEL))
    prompts = chat_prompts(model_dir, 64)
    chosen = workloads(prompts, 8 if args.smoke else 128)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    env = {**os.environ, "PYTHONPATH": f"{args.src}:{os.environ.get('PYTHONPATH', '')}"}
    servers: dict[str, tuple[list[str], dict[str, str]]] = {}
    flags = ["--dtype", "float32", "--model", MODEL, "--max-num-seqs", "64"]
    if not args.skip_hf:
        servers["tw-hf"] = ([sys.executable, "-m", "tokenwire.cli", "serve", *flags], env)
    if args.vllm_python:
        vllm_env = {**env, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
        command = [str(args.vllm_python), "-m", "tokenwire.cli", "serve", *flags]
        servers["tw-vllm"] = ([*command, "--engine", "vllm", "--enforce-eager"], vllm_env)
    results: dict[str, dict[str, tuple[float, float]]] = {}
    load = os.getloadavg()[0]
    for name, (command, server_env) in servers.items():
        print(f"{name}:")
        port = free_port()
        results[name] = measure_server([*command, "--port", str(port)], port, server_env, chosen)
    limit = None if args.skip_limit else static_batch(model_dir, prompts[:32])
    print(f"\nload average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    if limit is not None:
        rate, cost = limit[0], limit[1] * 1000
        print(f"static generate batch of 32 x 128: {rate:.1f} tok/s, {cost:.1f} ms CPU/token")
    names = list(results)
    print("| workload | " + " | ".join(f"{n} tok/s | {n} ms CPU/token" for n in names) + " |")
    print("| --- |" + " ---: | ---: |" * len(names))
    for work in chosen:
        cells = [f"{results[n][work][0]:.1f} | {results[n][work][1] * 1000:.1f}" for n in names]
        print(f"| {work} | " + " | ".join(cells) + " |")
    if "tw-hf" in results and "tw-vllm" in results:
        for work in chosen:
            hf, vl = results["tw-hf"][work], results["tw-vllm"][work]
            print(f"{work}: hf/vllm CPU per token {hf[1] / vl[1]:.2f}x, tok/s {hf[0] / vl[0]:.2f}x")
    if limit is not None and "tw-hf" in results and "32x128" in chosen:
        print(f"32x128: hf / static batch tok/s {results['tw-hf']['32x128'][0] / limit[0]:.2f}x")


if __name__ == "__main__":
    main()
