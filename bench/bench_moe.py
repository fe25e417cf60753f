"""MoE decode on the hf engine: CPU per output token of qwen3-moe-tiny with routed-experts
capture off and on, against a dense Qwen3 of the same active size (its MLP as wide as the two
experts a token runs: intermediate 2 x 32), in one run, interleaved rounds.

In-process engines (no HTTP: the frontend's cost is the same for all three). Each round: a
batch of 16 requests at once, 32-id random prompts, 64 output tokens (``ignore_eos``,
temperature 1). CPU is the process's (every thread), divided by the output tokens.

Usage: ``python bench/bench_moe.py [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenwire.assets import prepare
from tokenwire.assets.qwen3_moe_tiny import MOE_INTERMEDIATE_SIZE, TOP_K
from tokenwire.assets.qwen3_tiny import save_generation_config, text_config_kwargs
from tokenwire.engine.base import SamplingParams
from tokenwire.engine.hf import HFEngine


def dense_twin(root: Path) -> Path:
    """A dense Qwen3 with qwen3-moe-tiny's attention and its active MLP width."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **{**text_config_kwargs(), "intermediate_size": TOP_K * MOE_INTERMEDIATE_SIZE},
        head_dim=16,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    out = root / "qwen3-dense-twin"
    Qwen3ForCausalLM(config).save_pretrained(str(out))
    save_generation_config(out)
    return out


async def one_round(engine: HFEngine, batch: int, prompt: int, output: int, seed: int) -> int:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output, temperature=1.0, ignore_eos=True)

    async def one(i: int) -> int:
        ids = [rng.randrange(1000, 100_000) for _ in range(prompt)]
        count = 0
        async for out in engine.generate(f"r{seed}-{i}", ids, params):
            count += len(out.new_token_ids)
        return count

    return sum(await asyncio.gather(*(one(i) for i in range(batch))))


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        moe_dir = prepare("qwen3-moe-tiny")
        engines: dict[str, Any] = {
            "moe, capture off": HFEngine(moe_dir, prefix_cache_bytes=0, threads=1),
            "moe, capture on": HFEngine(
                moe_dir, prefix_cache_bytes=0, threads=1, return_routed_experts=True
            ),
            "dense, same active size": HFEngine(
                dense_twin(Path(tmp)), prefix_cache_bytes=0, threads=1
            ),
        }
        for engine in engines.values():
            await engine.start()
        cpu = dict.fromkeys(engines, 0.0)
        tokens = dict.fromkeys(engines, 0)
        for r in range(args.rounds):
            for name, engine in engines.items():
                began = time.process_time()
                tokens[name] += await one_round(engine, args.batch, 32, args.output, r)
                cpu[name] += time.process_time() - began
        for engine in engines.values():
            await engine.shutdown()
    base = cpu["moe, capture off"] / tokens["moe, capture off"]
    print(f"{'engine':<26} {'ms CPU / token':>15} {'vs moe off':>11}")
    for name in engines:
        per = cpu[name] / tokens[name]
        print(f"{name:<26} {per * 1e3:>15.3f} {per / base:>10.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="one tiny round (CI's smoke run)")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.batch, args.output = 1, 2, 4
    asyncio.run(main(args))
