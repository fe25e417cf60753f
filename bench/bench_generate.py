"""Generate throughput of the hf engine against plain transformers, on this machine.

Compares, for each concurrency N, in one run:
- the engine with N concurrent requests (greedy, ignore_eos, fixed output length);
- one static left-padded ``model.generate`` batch of the same N prompts (with attention_mask);
- a sequential ``model.generate`` loop (rate measured on a few requests, extrapolated).
Also reports time-to-first-token and per-token latency percentiles seen by engine clients.

Usage: ``python bench/bench_generate.py [--quick] [--sizes 1,8,32,64] [--tokens 128]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenwire.assets import prepare
from tokenwire.engine.base import SamplingParams
from tokenwire.engine.hf import HFEngine

TOPICS = [
    "the ocean",
    "a lighthouse keeper who collects old maps of forgotten islands",
    "why the sky is blue",
    "a robot learning to paint with watercolors in a small studio by the sea",
    "bread",
    "the history of the printing press and its effect on literacy in Europe",
    "cats",
    "a detective story set on a night train crossing the mountains in winter",
    "prime numbers",
    "how bees communicate the location of flowers to the rest of their hive",
]


def make_prompts(tokenizer: AutoTokenizer, count: int) -> list[list[int]]:
    """Chat-templated prompts of roughly 20-60 tokens."""
    prompts = []
    for i in range(count):
        text = f"Write about {TOPICS[i % len(TOPICS)]}." + (" Be brief." if i % 3 == 0 else "")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return prompts


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@dataclass
class EngineRun:
    tok_s: float
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


async def run_engine(engine: HFEngine, prompts: list[list[int]], tokens: int) -> EngineRun:
    sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    ttft: list[float] = []
    itl: list[float] = []

    async def one(i: int, prompt: list[int]) -> int:
        t0 = time.perf_counter()
        last = t0
        count = 0
        async for out in engine.generate(f"bench-{i}", prompt, sampling):
            now = time.perf_counter()
            if count == 0:
                ttft.append(now - t0)
            elif out.new_token_ids:
                # coalesced outputs: spread the gap over the tokens they carry
                itl.extend([(now - last) / len(out.new_token_ids)] * len(out.new_token_ids))
            count += len(out.new_token_ids)
            last = now
        return count

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - t0
    assert all(c == tokens for c in counts), counts
    return EngineRun(sum(counts) / elapsed, ttft, itl)


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


@torch.inference_mode()
def run_static(model: torch.nn.Module, prompts: list[list[int]], tokens: int, pad: int) -> float:
    ids, mask = left_pad(prompts, pad)
    t0 = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=tokens,
        min_new_tokens=tokens,  # suppresses eos: fixed-length outputs like ignore_eos
        do_sample=False,
        pad_token_id=pad,
    )
    elapsed = time.perf_counter() - t0
    assert out.shape[1] - ids.shape[1] == tokens
    return len(prompts) * tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes 1,8,32 and 32 tokens")
    parser.add_argument("--sizes", default=None, help="comma-separated concurrencies")
    parser.add_argument("--tokens", type=int, default=None, help="output tokens per request")
    parser.add_argument("--sequential-requests", type=int, default=None)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.tokens, args.sequential_requests = "2", 4, 1
    sizes = [int(s) for s in (args.sizes or ("1,8,32" if args.quick else "1,8,32,64")).split(",")]
    tokens = args.tokens or (32 if args.quick else 128)
    seq_requests = args.sequential_requests or (3 if args.quick else 4)

    model_dir = Path(prepare(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = make_prompts(tokenizer, max(sizes))
    lengths = [len(p) for p in prompts]
    print(f"model {model_dir.name}, torch threads {torch.get_num_threads()}, {tokens} tokens/req,")
    print(f"prompt tokens {min(lengths)}-{max(lengths)}")

    run_static(model, prompts[:2], 4, pad)  # warm-up
    seq_rates: list[float] = []

    def sequential_sample(count: int) -> None:
        """Single-request generate runs, spread between the others so noise hits all alike."""
        for p in prompts[len(seq_rates) : len(seq_rates) + count]:
            seq_rates.append(run_static(model, [p], tokens, pad))

    engine = HFEngine(model_dir, max_num_seqs=max(sizes), device="cpu")

    async def bench() -> list[tuple[int, float, EngineRun]]:
        await engine.start()
        await run_engine(engine, prompts[:2], 4)  # warm-up
        rows = []
        per_size = [seq_requests // len(sizes)] * len(sizes)
        for i in range(seq_requests % len(sizes)):
            per_size[i] += 1
        for n, seq_count in zip(sizes, per_size, strict=True):
            await asyncio.to_thread(sequential_sample, seq_count)
            # Alternate static and engine runs so machine noise hits both alike.
            static = await asyncio.to_thread(run_static, model, prompts[:n], tokens, pad)
            result = await run_engine(engine, prompts[:n], tokens)
            rows.append((n, static, result))
            print(
                f"  n={n}: static {static:.1f} tok/s, engine {result.tok_s:.1f} tok/s", flush=True
            )
        await engine.shutdown()
        return rows

    rows = asyncio.run(bench())
    sequential = statistics.median(seq_rates)
    print()
    print(
        "| concurrent | engine tok/s | static batch tok/s | engine/static | engine/sequential "
        "| TTFT p50/p90/p99 (s) | per-token p50/p90/p99 (ms) |"
    )
    print("|---:|---:|---:|---:|---:|---|---|")
    for n, static, r in rows:
        ttft = "/".join(f"{pct(r.ttft, q):.2f}" for q in (50, 90, 99))
        itl = "/".join(f"{1000 * pct(r.itl, q):.0f}" for q in (50, 90, 99))
        print(
            f"| {n} | {r.tok_s:.1f} | {static:.1f} | {r.tok_s / static:.2f}x "
            f"| {r.tok_s / sequential:.1f}x | {ttft} | {itl} |"
        )
    print(
        f"\nsequential model.generate loop: {sequential:.1f} tok/s "
        f"(median of {len(seq_rates)} single requests, spread over the run)"
    )


if __name__ == "__main__":
    main()
