"""Where a 32-concurrent decode step of the hf engine spends its time (issue 23, item 2).

Drives the engine's own scheduler and runner in this thread (no server, no engine thread): 32
chat prompts are prefilled, a few decode steps warm up, then ``--steps`` decode steps are timed
part by part (the forward, sampling, the scheduler's bookkeeping) and profiled by
``torch.profiler`` (the top operators by self CPU time).

Usage: ``python bench/profile_decode.py [--rows 32] [--steps 20] [--threads N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from tokenwire.assets import prepare
from tokenwire.engine.base import SamplingParams
from tokenwire.engine.defaults import default_engine_threads
from tokenwire.engine.hf.handoff import Add, Command, Request, Sink
from tokenwire.engine.hf.runner import ModelRunner
from tokenwire.engine.hf.scheduler import Scheduler

TOPICS = ["the ocean", "bread", "a night train", "prime numbers", "owls", "glass", "tea", "jazz"]


def timed(method: Callable[..., Any], parts: dict[str, float], name: str) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        began = time.perf_counter()
        try:
            return method(*args)
        finally:
            parts[name] += time.perf_counter() - began

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--seeded", action="store_true", help="every request has a seed")
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.steps = 2, 2
    model_dir = Path(prepare("smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    runner = ModelRunner(
        model_dir,
        vision=None,
        vocab_size=0,
        max_num_seqs=64,
        device="cpu",
        dtype=None,
        threads=args.threads or default_engine_threads(),
    )
    runner.load()
    inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
    scheduler = Scheduler(
        runner,
        inbox,
        max_num_seqs=64,
        max_model_len=8192,
        prefix_cache_bytes=0,
        max_num_batched_tokens=4096,
    )
    loop = asyncio.new_event_loop()  # never run: outputs queue up unread
    seed = 1 if args.seeded else None
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True, seed=seed)
    for i in range(args.rows):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write about {TOPICS[i % 8]} (take {i})."}],
            add_generation_prompt=True,
        )
        prompt = list(ids if isinstance(ids, list) else ids["input_ids"])
        sink = Sink(loop, asyncio.Queue())
        inbox.put(Add(Request(f"r{i}", prompt, params, sink)))
    with torch.inference_mode():
        scheduler._drain_inbox([], block=False)
        while scheduler.waiting and (group := scheduler._prefill_turn()):
            scheduler._prefill_step(group, [])
        for _ in range(3):
            scheduler._decode_step([])
        parts = {"forward": 0.0, "sample": 0.0}
        for name, method in (("forward", runner.decode), ("sample", runner.sample)):
            setattr(runner, method.__name__, timed(method, parts, name))
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(args.steps):
            scheduler._decode_step([])
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        step_ms = wall / args.steps * 1000
        print(
            f"{args.rows} rows, torch threads {torch.get_num_threads()}: {step_ms:.1f} ms/step, "
            f"{args.rows * args.steps / wall:.1f} tok/s, "
            f"{cpu / (args.rows * args.steps) * 1000:.2f} ms CPU/token"
        )
        parts["scheduler and the rest"] = wall - sum(parts.values())
        for name, seconds in parts.items():
            print(f"  {name}: {seconds / args.steps * 1000:.1f} ms/step ({seconds / wall:.0%})")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                scheduler._decode_step([])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
