"""Seeded sampling across batch shapes: does a seeded request get the same ids whatever runs?

Starts the embedded default model's server and, for each of K seeds, sends one seeded
temperature-1 request alone, then the same request together with 15 concurrent others (varied
prompt lengths, unseeded, some greedy). Prints the fraction of trials whose ids are identical.
RL users rely on "same seed, same tokens, whatever else runs".

Usage: ``python bench/bench_seed_invariance.py [--seeds 32] [--tokens 64]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serverbench import ServerProcess, free_port, tokenwire_command

QUESTIONS = [
    "Write a short poem about the sea.",
    "Explain in a few sentences why the sky is blue, as if to a curious ten-year-old child.",
    "List three prime numbers.",
    "Tell a story about a lighthouse keeper who collects old maps of forgotten islands, and "
    "the day a stranger arrives with a map of an island that is not on any of them.",
]
OTHERS = 15


def tokenize(url: str, text: str) -> list[int]:
    body = {"messages": [{"role": "user", "content": text}]}
    return httpx.post(f"{url}/tokenize", json=body, timeout=60).json()["tokens"]


async def generate(http: httpx.AsyncClient, ids: list[int], sampling: dict) -> list[int]:
    body = {"token_ids": ids, "sampling_params": sampling}
    response = await http.post("/inference/v1/generate", json=body)
    response.raise_for_status()
    return response.json()["choices"][0]["token_ids"]


async def trial(
    http: httpx.AsyncClient, prompt: list[int], seed: int, tokens: int, fillers: list[list[int]]
) -> bool:
    """The seeded request alone, then among OTHERS concurrent requests; True when ids agree."""
    sampling = {"temperature": 1.0, "seed": seed, "max_tokens": tokens, "ignore_eos": True}
    alone = await generate(http, prompt, sampling)
    rng = random.Random(seed)
    others = []
    for i in range(OTHERS):
        other = {"max_tokens": rng.randint(tokens // 2, tokens), "ignore_eos": True}
        other["temperature"] = 0.0 if i % 4 == 0 else 1.0
        # Varied prompt lengths: a filler question, sometimes repeated into a longer prompt.
        others.append(generate(http, rng.choice(fillers) * rng.randint(1, 4), other))
    # The seeded request goes in the middle, so it is prefilled and decoded among others.
    tasks = others[: OTHERS // 2] + [generate(http, prompt, sampling)] + others[OTHERS // 2 :]
    results = await asyncio.gather(*tasks)
    return results[OTHERS // 2] == alone


async def run(url: str, seeds: int, tokens: int) -> tuple[int, int]:
    prompts = [tokenize(url, q) for q in QUESTIONS]
    fillers = [tokenize(url, q * 2) for q in QUESTIONS]
    same = 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for k in range(seeds):
            ok = await trial(http, prompts[k % len(prompts)], 1000 + k, tokens, fillers)
            same += ok
            print(f"seed {1000 + k}: {'same' if ok else 'DIFFERENT'}", flush=True)
    return same, seeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=32, help="trials (one seed each)")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per seeded request")
    parser.add_argument("--url", default=None, help="a running server instead of a new one")
    parser.add_argument("--log", type=Path, default=Path("/tmp/tokenwire-seed-bench.log"))
    parser.add_argument("server_args", nargs="*", help="extra `tokenwire serve` flags")
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.smoke:
        args.seeds, args.tokens = 1, 4
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    server = None
    url = args.url
    if url is None:
        port = free_port()
        server = ServerProcess(tokenwire_command(port, *args.server_args), port, log=args.log)
        url = server.url
    try:
        same, total = asyncio.run(run(url, args.seeds, args.tokens))
    finally:
        if server is not None:
            server.stop()
    print(
        f"\nseeded temperature-1, {args.tokens} tokens: identical alone and among {OTHERS} others "
        f"in {same}/{total} trials ({same / total:.0%}); {time.perf_counter() - started:.0f} s; "
        f"load average before {load_before:.1f}, after {os.getloadavg()[0]:.1f} "
        f"({os.cpu_count()} CPUs)"
    )


if __name__ == "__main__":
    main()
