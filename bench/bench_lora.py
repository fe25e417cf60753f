"""LoRA over HTTP: output tokens/s of one batch of 32 requests spread over 4 adapters, all on one
adapter, and on the base model, against one server in one run (interleaved rounds).

Adapters are made here with PEFT (rank 16 on every attention and MLP projection, random
``lora_B``) and loaded at start-up. Each request: a 64-id prompt, 64 output tokens
(``ignore_eos``, temperature 1), all 32 sent at once to ``/inference/v1/generate``. The server's
CPU seconds per output token come from /proc (they hold on a loaded machine; wall time does not).

Usage: ``python bench/bench_lora.py [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import httpx
from serverbench import ServerProcess, cpu_seconds, free_port, tokenwire_command

from tokenwire.assets import prepare

BATCH, ADAPTERS, PROMPT_TOKENS, OUTPUT_TOKENS = 32, 4, 64, 64
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, root: Path) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(ADAPTERS):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False)
        path = root / f"adapter{i}"
        get_peft_model(base, config).save_pretrained(path)
        paths.append(path)
    return paths


async def batch(url: str, models: list[str | None]) -> tuple[int, float]:
    rng = random.Random(0)
    sampling = {"max_tokens": OUTPUT_TOKENS, "temperature": 1.0, "ignore_eos": True}

    async def one(client: httpx.AsyncClient, model: str | None) -> int:
        body = {
            "token_ids": [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)],
            "sampling_params": sampling,
            **({"model": model} if model else {}),
        }
        response = await client.post(url + "/inference/v1/generate", json=body)
        response.raise_for_status()
        return len(response.json()["choices"][0]["token_ids"])

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(client, m) for m in models))
    return sum(counts), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.smoke:
        global BATCH, OUTPUT_TOKENS  # the shape every helper reads
        args.rounds, BATCH, OUTPUT_TOKENS = 1, ADAPTERS, 4
    model_dir = prepare("smollm2-135m-instruct")
    shapes: dict[str, list[str | None]] = {
        "base model": [None] * BATCH,
        "one adapter": ["a0"] * BATCH,
        f"{ADAPTERS} adapters": [f"a{i % ADAPTERS}" for i in range(BATCH)],
    }
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(model_dir, Path(tmp))
        port = free_port()
        modules = [f"a{i}={path}" for i, path in enumerate(adapters)]
        flags = ["--enable-lora", "--max-loras", str(ADAPTERS), "--max-lora-rank", "16"]
        flags += ["--prefix-cache-bytes", "0", "--lora-modules", *modules]
        server = ServerProcess(tokenwire_command(port, *flags), port)
        totals = {name: [0, 0.0, 0.0] for name in shapes}  # tokens, seconds, server CPU
        try:
            asyncio.run(batch(server.url, [None] * 4))  # warm-up
            for _ in range(args.rounds):
                for name, models in shapes.items():
                    cpu = cpu_seconds(server.process.pid)
                    tokens, seconds = asyncio.run(batch(server.url, models))
                    totals[name][0] += tokens
                    totals[name][1] += seconds
                    totals[name][2] += cpu_seconds(server.process.pid) - cpu
        finally:
            server.stop()
    base_rate = totals["base model"][0] / totals["base model"][1]
    print(f"{BATCH} requests x {OUTPUT_TOKENS} tokens, {args.rounds} interleaved rounds")
    print(f"{'shape':<14} {'tok/s':>8} {'vs base':>8} {'CPU ms/token':>13}")
    for name, (tokens, seconds, cpu) in totals.items():
        rate = tokens / seconds
        print(f"{name:<14} {rate:8.1f} {rate / base_rate:7.2f}x {1000 * cpu / tokens:13.2f}")


if __name__ == "__main__":
    main()
