"""Innocent streams under a prefill flood: does a long prompt starve running decodes?

In one run, on the hf engine in process (SmolLM2-135M), two phases of the same length:
- solo: 8 streams decode (greedy, ignore_eos) and nothing else runs;
- flood: the same 8 streams while 6 clients each send 1000-token prompts with ``max_tokens: 1``,
  one after another (fresh random ids each time, so the prefix cache never helps).
Reports each phase's stream tokens/s, p50/p99 inter-token latency and the flood/solo ratio
(issue 22's target: at least 0.5x), plus the prompts the flood got prefilled.

Usage: ``python bench/bench_prefill_flood.py [--seconds 20] [--max-num-batched-tokens N]``.
Run it with another tree's ``src`` on PYTHONPATH to measure that tree (the flag needs this one).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from tokenwire.assets import prepare
from tokenwire.engine.base import SamplingParams
from tokenwire.engine.hf import HFEngine

STREAMS = 8
FLOODERS = 6
FLOOD_PROMPT = 1000


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def phase(
    engine: HFEngine, prompts: list[list[int]], seconds: float, flood: bool, tag: str
) -> dict[str, Any]:
    """Stream for ``seconds`` (after every stream's first token), with or without the flood."""
    stream = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    arrivals: list[list[float]] = [[] for _ in prompts]
    started = asyncio.Event()
    stop = asyncio.Event()
    prefilled = 0

    async def innocent(i: int) -> None:
        async for out in engine.generate(f"{tag}-s{i}", prompts[i], stream):
            now = time.perf_counter()
            arrivals[i].extend([now] * len(out.new_token_ids))
            if all(arrivals):
                started.set()
            if stop.is_set():
                return  # closing the stream aborts it

    async def flooder(j: int) -> None:
        nonlocal prefilled
        rng = random.Random(j)
        one = SamplingParams(max_tokens=1, temperature=0)
        k = 0
        while not stop.is_set():
            ids = [rng.randrange(10, 49000) for _ in range(FLOOD_PROMPT)]
            async for _ in engine.generate(f"{tag}-f{j}-{k}", ids, one):
                pass
            prefilled += 1
            k += 1

    tasks = [asyncio.create_task(innocent(i)) for i in range(len(prompts))]
    await started.wait()
    begin = time.perf_counter()
    if flood:
        tasks += [asyncio.create_task(flooder(j)) for j in range(FLOODERS)]
    await asyncio.sleep(seconds)
    end = time.perf_counter()
    stop.set()
    await asyncio.gather(*tasks)
    window = [[t for t in times if begin <= t <= end] for times in arrivals]
    gaps = [b - a for times in window for a, b in itertools.pairwise(times)]
    tokens = sum(map(len, window))
    return {
        "tok_s": tokens / (end - begin) / len(prompts),
        "p50": pct(gaps, 50) * 1000,
        "p99": pct(gaps, 99) * 1000,
        "prefilled": prefilled,
    }


async def main(args: argparse.Namespace) -> None:
    model_dir = Path(prepare("smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    kwargs = {}
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    engine = HFEngine(model_dir, max_num_seqs=64, device="cpu", **kwargs)
    await engine.start()
    prompts = []
    for i in range(STREAMS):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Tell me a long story about island number {i}."}],
            add_generation_prompt=True,
        )
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    print(f"torch threads {torch.get_num_threads()}, {args.seconds:.0f} s per phase")
    print("| round | phase | stream tok/s | p50 ITL ms | p99 ITL ms | flood prompts |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    ratios = []
    for r in range(args.rounds):
        solo = await phase(engine, prompts, args.seconds, False, f"r{r}solo")
        flood = await phase(engine, prompts, args.seconds, True, f"r{r}flood")
        for name, res in (("solo", solo), ("flood", flood)):
            print(
                f"| {r} | {name} | {res['tok_s']:.2f} | {res['p50']:.0f} | {res['p99']:.0f} "
                f"| {res['prefilled']} |"
            )
        ratios.append(flood["tok_s"] / solo["tok_s"])
    print(f"flood/solo stream tokens/s: {', '.join(f'{x:.2f}x' for x in ratios)} (target >= 0.5x)")
    await engine.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.smoke:
        args.seconds, args.rounds = 2.0, 1
    asyncio.run(main(args))
