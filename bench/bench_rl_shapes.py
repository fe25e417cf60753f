"""RL rollout shapes with the prefix cache on and off, in one run (output tokens/s and ratios).

Shapes (in process, SmolLM2-135M, temperature 1, unseeded as RL rollouts are (a seeded request
never reads the cache: its ids must not depend on what ran before), ``ignore_eos``):
- GRPO: ``--prompts`` prompts of ~512 tokens, ``n = 8`` each (8 engine requests with one prompt,
  as the pipeline fans ``n`` out), 64 output tokens each, all submitted at once;
- multi-turn: ``--rollouts`` rollouts of 4 turns, run concurrently; turn 1 is a ~512-token
  prompt, each later turn is the previous prompt + its 32 output ids + ~60 new ids.

Engines: the hf engine with ``prefix_cache_bytes`` at its default and at 0; with ``--vllm`` (run
from .venv-vllm, ``make bench-vllm`` style env) also vLLM's engine with prefix caching on and off
(``--no-enable-prefix-caching``), float32 and eager. Prompts are seeded random ids: the shapes,
not the text, decide the cost.

Usage: ``python bench/bench_rl_shapes.py [--quick] [--vllm]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from tokenwire.assets import prepare
from tokenwire.engine.base import Engine, SamplingParams
from tokenwire.engine.factory import DEFAULT_PREFIX_CACHE_BYTES, create_engine

PROMPT_TOKENS = 512
GRPO_CACHED = "GRPO, prompts already cached"
GRPO_N, GRPO_TOKENS = 8, 64
TURNS, TURN_NEW_TOKENS, TURN_TOKENS = 4, 60, 32


def random_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(count)]


async def one(engine: Engine, rid: str, prompt: list[int], sampling: SamplingParams) -> list[int]:
    ids: list[int] = []
    async for out in engine.generate(rid, prompt, sampling):
        ids += out.new_token_ids
    return ids


async def grpo(engine: Engine, tag: str, prompts: int) -> tuple[int, float]:
    """All prompts' n choices at once; returns (output tokens, seconds)."""
    rng = random.Random(1)
    batch = [random_ids(rng, PROMPT_TOKENS) for _ in range(prompts)]
    jobs = [
        one(
            engine,
            f"{tag}-{p}-{i}",
            prompt,
            SamplingParams(max_tokens=GRPO_TOKENS, temperature=1.0, ignore_eos=True),
        )
        for p, prompt in enumerate(batch)
        for i in range(GRPO_N)
    ]
    t0 = time.perf_counter()
    outputs = await asyncio.gather(*jobs)
    return sum(map(len, outputs)), time.perf_counter() - t0


async def multi_turn(engine: Engine, tag: str, rollouts: int) -> tuple[int, float]:
    """Concurrent rollouts, each turn extending the previous turn's ids."""
    sampling = SamplingParams(max_tokens=TURN_TOKENS, temperature=1.0, ignore_eos=True)

    async def rollout(r: int) -> int:
        rng = random.Random(100 + r)
        prompt, produced = random_ids(rng, PROMPT_TOKENS), 0
        for turn in range(TURNS):
            output = await one(engine, f"{tag}-{r}-{turn}", prompt, sampling)
            produced += len(output)
            prompt = [*prompt, *output, *random_ids(rng, TURN_NEW_TOKENS)]
        return produced

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(rollout(r) for r in range(rollouts)))
    return sum(counts), time.perf_counter() - t0


@dataclass
class Config:
    label: str
    kind: str
    cache: bool


def build(config: Config, model_dir: Path) -> Engine:
    if config.kind == "vllm":
        extra = ["--enforce-eager"] + ([] if config.cache else ["--no-enable-prefix-caching"])
        return create_engine(
            "vllm",
            model_dir,
            max_model_len=4096,
            max_num_seqs=64,
            dtype="float32",
            extra_args=extra,
        )
    return create_engine(
        "hf",
        model_dir,
        max_model_len=4096,
        max_num_seqs=64,
        device="cpu",
        prefix_cache_bytes=DEFAULT_PREFIX_CACHE_BYTES if config.cache else 0,
    )


async def measure(config: Config, model_dir: Path, prompts: int, rollouts: int) -> dict[str, float]:
    engine = build(config, model_dir)
    await engine.start()
    try:
        await one(engine, "warm", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
        rates = {}
        for name, shape, size in (("GRPO", grpo, prompts), ("multi-turn", multi_turn, rollouts)):
            tokens, seconds = await shape(engine, f"{config.label}-{name}", size)
            rates[name] = tokens / seconds
            print(f"  {config.label} {name}: {tokens} tokens in {seconds:.1f} s", flush=True)
        if config.cache:
            # The same GRPO prompts again, every block cached: what is left is decode (and one
            # block per request), the floor no prefix cache can go below.
            tokens, seconds = await grpo(engine, f"{config.label}-again", prompts)
            rates[GRPO_CACHED] = tokens / seconds
            print(f"  {config.label} {GRPO_CACHED}: {tokens} tokens in {seconds:.1f} s", flush=True)
        return rates
    finally:
        await engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 GRPO prompts, 4 rollouts")
    parser.add_argument("--prompts", type=int, default=None, help="GRPO prompts (default 8)")
    parser.add_argument("--rollouts", type=int, default=None, help="rollouts (default 8)")
    parser.add_argument("--vllm", action="store_true", help="vLLM's engine too (.venv-vllm)")
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.rollouts = 1, 1
    prompts = args.prompts or (4 if args.quick else 8)
    rollouts = args.rollouts or (4 if args.quick else 8)
    model_dir = Path(prepare("smollm2-135m-instruct"))
    configs = [Config("hf cache off", "hf", False), Config("hf cache on", "hf", True)]
    if args.vllm:
        configs += [Config("vllm cache off", "vllm", False), Config("vllm cache on", "vllm", True)]
    print(
        f"GRPO {prompts} x {PROMPT_TOKENS} tokens, n={GRPO_N}, {GRPO_TOKENS} out; multi-turn "
        f"{rollouts} x {TURNS} turns, +{TURN_NEW_TOKENS} ids/turn, {TURN_TOKENS} out; "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    results = {c.label: asyncio.run(measure(c, model_dir, prompts, rollouts)) for c in configs}
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    print("\n| engine | GRPO out tok/s | multi-turn out tok/s |")
    print("|---|---:|---:|")
    for label, rates in results.items():
        print(f"| {label} | {rates['GRPO']:.1f} | {rates['multi-turn']:.1f} |")
    for kind in ("hf", "vllm"):
        on, off = results.get(f"{kind} cache on"), results.get(f"{kind} cache off")
        if on and off:
            ratios = ", ".join(f"{shape} {on[shape] / off[shape]:.2f}x" for shape in off)
            print(f"{kind} cache on / off: {ratios}")
            bound = on[GRPO_CACHED] / off["GRPO"]
            print(f"{kind} GRPO bound (every prompt cached / off): {bound:.2f}x")


if __name__ == "__main__":
    main()
