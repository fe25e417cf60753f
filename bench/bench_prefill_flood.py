"""Innocent streams and new requests under a prefill flood: does a long prompt starve them?

In one run, on the hf engine in process (SmolLM2-135M), two phases of the same length:
- solo: 8 streams decode (greedy, ignore_eos) and a probe client sends a new short chat prompt
  (``max_tokens: 1``, a fresh question each time) every half second after the last answer;
- flood: the same, while 6 clients each send 1000-token prompts with ``max_tokens: 1``, one after
  another (fresh random ids each time, so the prefix cache never helps).
Reports each phase's stream tokens/s, p50/p99 inter-token latency, the probes' time to first
token (p50/p90) and the prompts the flood got prefilled, then the flood/solo ratios: stream
tokens/s (issue 22's target: at least 0.5x) and probe TTFT (issue 34's: at most 5x).

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
PROBE_GAP_S = 0.5


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def phase(
    engine: HFEngine,
    prompts: list[list[int]],
    probes: list[list[int]],
    seconds: float,
    flood: bool,
    tag: str,
) -> dict[str, Any]:
    """Stream and probe for ``seconds`` (after every stream's first token), with or without the
    flood. A probe still waiting at the end is waited for (its TTFT counts)."""
    stream = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0)
    arrivals: list[list[float]] = [[] for _ in prompts]
    ttfts: list[float] = []
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

    async def prober() -> None:
        for k in itertools.count():
            sent = time.perf_counter()
            async for _ in engine.generate(f"{tag}-p{k}", probes[k % len(probes)], one):
                ttfts.append(time.perf_counter() - sent)
            if stop.is_set():
                return
            await asyncio.sleep(PROBE_GAP_S)

    async def flooder(j: int) -> None:
        nonlocal prefilled
        rng = random.Random(j)
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
    tasks.append(asyncio.create_task(prober()))
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
        "ttft50": pct(ttfts, 50),
        "ttft90": pct(ttfts, 90),
        "probes": len(ttfts),
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

    def chat(content: str) -> list[int]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    prompts = [chat(f"Tell me a long story about island number {i}.") for i in range(STREAMS)]
    probes = [chat(f"What is {k} plus {k + 7}? Answer with the number.") for k in range(500)]
    print(
        f"torch threads {torch.get_num_threads()}, {args.seconds:.0f} s per phase, "
        f"probe prompts {len(probes[0])} tokens"
    )
    print(
        "| round | phase | stream tok/s | p50 ITL ms | p99 ITL ms | probe TTFT p50 s "
        "| probe TTFT p90 s | probes | flood prompts |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rates, ttft50, ttft90 = [], [], []
    for r in range(args.rounds):
        solo = await phase(engine, prompts, probes, args.seconds, False, f"r{r}solo")
        flood = await phase(engine, prompts, probes, args.seconds, True, f"r{r}flood")
        for name, res in (("solo", solo), ("flood", flood)):
            print(
                f"| {r} | {name} | {res['tok_s']:.2f} | {res['p50']:.0f} | {res['p99']:.0f} "
                f"| {res['ttft50']:.2f} | {res['ttft90']:.2f} | {res['probes']} "
                f"| {res['prefilled']} |"
            )
        rates.append(flood["tok_s"] / solo["tok_s"])
        ttft50.append(flood["ttft50"] / solo["ttft50"])
        ttft90.append(flood["ttft90"] / solo["ttft90"])

    def listed(xs: list[float]) -> str:
        return ", ".join(f"{x:.2f}x" for x in xs)

    print(f"flood/solo stream tokens/s: {listed(rates)} (target >= 0.5x)")
    print(f"flood/solo probe TTFT p50: {listed(ttft50)}, p90: {listed(ttft90)} (target <= 5x)")
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
