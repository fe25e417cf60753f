"""The hf scheduler under long prompts: chunked prefill stays exact and never starves decodes."""

from __future__ import annotations

import asyncio
import math
import queue
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tests.conftest import run_async
from tests.test_engine_hf import Result, assert_parity, chat, collect, full_logprobs
from tokenwire.assets import prepare
from tokenwire.engine.base import SamplingParams
from tokenwire.engine.hf import HFEngine
from tokenwire.engine.hf.handoff import NewWeights, Reply, Request, Sink
from tokenwire.engine.hf.runner import ModelRunner
from tokenwire.engine.hf.scheduler import SHORT_FIRST_WEIGHT, Scheduler

pytestmark = [pytest.mark.hf_only, pytest.mark.model]

run = run_async
CHUNK = 32  # small, so that short prompts (cheap to check) take several chunks


@pytest.fixture(scope="module")
def chunked(smol_dir: Path) -> Iterator[HFEngine]:
    eng = HFEngine(smol_dir, max_num_seqs=16, device="cpu", max_num_batched_tokens=CHUNK)
    run(eng.start())
    yield eng
    run(eng.shutdown())


def test_chunked_prefill_keeps_parity_and_prompt_logprobs(
    chunked: HFEngine, tokenizer: AutoTokenizer, ref_model: torch.nn.Module
) -> None:
    """A 100+-token prompt in 32-token chunks: output and prompt logprobs equal one full
    forward within 1e-4; a second turn takes its first blocks from the prefix cache and
    chunks only the rest, with parity."""
    prompt = chat(tokenizer, "Describe the water cycle for a child, in simple steps. " * 6)
    assert len(prompt) > 3 * CHUNK and len(prompt) % CHUNK
    before = chunked.stats().extra["prefill_steps"]
    greedy = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    first = run(collect(chunked, "chunk-1", prompt, greedy))
    assert chunked.stats().extra["prefill_steps"] - before == math.ceil(len(prompt) / CHUNK)
    assert_parity(ref_model, prompt, first, 3)

    scored = run(
        collect(chunked, "chunk-plp", prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))
    )
    plp = scored.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    lp = full_logprobs(ref_model, prompt)
    for t in range(1, len(prompt)):
        entry = plp[t]
        assert entry is not None and entry.token_id == prompt[t]
        assert abs(entry.logprob - float(lp[t - 1, prompt[t]])) < 1e-4

    second = prompt + first.tokens + chat(tokenizer, "Now the same for snow, in detail. " * 3)
    again = run(collect(chunked, "chunk-2", second, greedy))
    assert again.cached >= len(prompt) - 16  # the first turn's blocks (at most 16 recomputed)
    assert len(second) - again.cached > CHUNK  # so the rest was chunked too
    assert_parity(ref_model, second, again, 3)


def test_seeded_chunked_prompt_is_the_same_under_a_flood(
    chunked: HFEngine, tokenizer: AutoTokenizer
) -> None:
    """Chunk boundaries depend on the prompt only: a seeded request samples the same ids alone
    and while other long prompts are chunked and decoded around it."""
    prompt = chat(tokenizer, "Invent a short story about a lighthouse keeper. " * 3)
    assert len(prompt) > CHUNK
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    alone = run(collect(chunked, "seed-alone", prompt, seeded))

    async def flooded() -> Result:
        others = [
            collect(chunked, f"seed-flood-{i}", chat(tokenizer, f"Topic {i}. " * 30), seeded)
            for i in range(3)
        ]
        results = await asyncio.gather(collect(chunked, "seed-mixed", prompt, seeded), *others)
        return results[0]

    assert run(flooded()).tokens == alone.tokens


def test_a_prefill_flood_never_leaves_running_rows_undecoded() -> None:
    """Two streams decode while six clients send 1000-token prompts with max_tokens 1: every
    prompt is chunked, at most one prefill forward ever runs between two decode steps, and the
    streams decode while the flood is prefilled (their rate is bench/bench_prefill_flood.py's)."""
    eng = HFEngine(
        Path(prepare("qwen3-tiny")), max_num_seqs=8, device="cpu", max_num_batched_tokens=64
    )
    run(eng.start())
    try:
        stream = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        flood = SamplingParams(max_tokens=1, temperature=0)
        progress = {"streamed": 0, "during_flood": 0, "flooding": 0}

        async def innocent(i: int) -> Result:
            res = Result()
            async for out in eng.generate(f"innocent-{i}", [100 + i] * 20, stream):
                res.tokens += out.new_token_ids
                progress["streamed"] += len(out.new_token_ids)
                if progress["flooding"]:
                    progress["during_flood"] += len(out.new_token_ids)
            return res

        async def flooder(i: int) -> Result:
            return await collect(
                eng, f"flood-{i}", [(7 * i + t) % 5000 + 10 for t in range(1000)], flood
            )

        async def main() -> tuple[list[Result], list[Result]]:
            streams = [asyncio.create_task(innocent(i)) for i in range(2)]
            while progress["streamed"] < 4:
                await asyncio.sleep(0.01)
            progress["flooding"] = 1
            floods = await asyncio.gather(*(flooder(i) for i in range(6)))
            progress["flooding"] = 0
            return list(await asyncio.gather(*streams)), list(floods)

        before = eng.stats().extra["prefill_steps"]
        streams, floods = run(main())
        assert all(len(r.tokens) == 400 for r in streams)
        assert all(len(r.tokens) == 1 and r.finish == "length" for r in floods)
        stats = eng.stats().extra
        assert stats["prefill_steps"] - before >= 6 * math.ceil(1000 / 64)
        assert stats["max_prefills_between_decodes"] == 1
        # Each of the ~96 chunks was followed by at least one decode step of both streams.
        assert progress["during_flood"] >= 2 * 6 * math.ceil(1000 / 64)
    finally:
        run(eng.shutdown())


@pytest.fixture(scope="module")
def tiny_runner() -> ModelRunner:
    runner = ModelRunner(
        Path(prepare("qwen3-tiny")),
        vision=None,
        vocab_size=0,
        max_num_seqs=4,
        device="cpu",
        dtype=None,
        threads=1,
    )
    runner.load()
    return runner


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()  # never run: outputs and replies queue up unread
    yield loop
    loop.close()


def scripted(runner: ModelRunner) -> Scheduler:
    """A scheduler stepped by the test (``step``), not by its thread: steps in a fixed order."""
    runner.reset_cache()  # rows an earlier test left running
    return Scheduler(
        runner,
        queue.SimpleQueue(),
        max_num_seqs=4,
        max_model_len=4096,
        prefix_cache_bytes=0,
        max_num_batched_tokens=64,
    )


def step(scheduler: Scheduler) -> None:
    """One step as ``Scheduler.run`` takes it, minus the clock: with nothing owed to the decode
    steps, a prefill whenever a request waits."""
    with torch.inference_mode():
        group = scheduler._prefill_turn() if scheduler.waiting else []
        if group:
            scheduler._prefill_step(group, [])
        else:
            scheduler._decode_step([])


def admit(
    scheduler: Scheduler,
    loop: asyncio.AbstractEventLoop,
    rid: str,
    length: int,
    max_tokens: int,
    offset: int = 0,
) -> Request:
    """Queue a greedy request as the engine thread does when it arrives."""
    prompt = [(5 * t + offset) % 3000 + 10 for t in range(length)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    req = Request(rid, prompt, params, Sink(loop, asyncio.Queue()))
    scheduler._admit(req, [])
    return req


def test_a_short_prompt_goes_before_long_prefills_queued_ahead_of_it(
    tiny_runner: ModelRunner, loop: asyncio.AbstractEventLoop
) -> None:
    """Three 200-token prompts (4 chunks each) wait; a 20-token one arrives after the first
    chunk and gets its first token on the next step, before any long prompt has one. The long
    ones then prefill one at a time (one chunk cache), in arrival order."""
    scheduler = scripted(tiny_runner)
    longs = [admit(scheduler, loop, f"long-{i}", 200, 1, offset=i) for i in range(3)]
    step(scheduler)
    assert longs[0].progress is not None and longs[0].progress.done == 64
    short = admit(scheduler, loop, "short", 20, 4)
    step(scheduler)
    assert short.output and not any(r.output for r in longs)
    first_token: dict[str, int] = {}
    for n in range(40):
        assert sum(r.progress is not None for r in scheduler.waiting) <= 1
        for req in [*longs, short]:
            if req.output and req.request_id not in first_token:
                first_token[req.request_id] = n
        if not (scheduler.waiting or scheduler.running):
            break
        step(scheduler)
    assert short.finish == "length" and len(short.output) == 4
    assert all(r.finish == "length" for r in longs)
    order = sorted(first_token, key=first_token.__getitem__)
    assert order == ["short", "long-0", "long-1", "long-2"]


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones(
    tiny_runner: ModelRunner, loop: asyncio.AbstractEventLoop
) -> None:
    """Shortest first ages: a new 20-token prompt every step passes a waiting 256-token one only
    while it ranks lower (arrival on the prefill clock + SHORT_FIRST_WEIGHT x length), so the
    long one goes after a bounded number of them, and keeps going until it is done."""
    scheduler = scripted(tiny_runner)
    long = admit(scheduler, loop, "long", 256, 1)
    passed = 0
    for n in range(40 * SHORT_FIRST_WEIGHT):
        admit(scheduler, loop, f"short-{n}", 20, 1)
        step(scheduler)
        if long.output:
            break
        if long.progress is None:
            passed += 1
    assert long.finish == "length"
    # the n-th short, admitted at clock 20 n, ranks 20 n + 20 w: below the long one's 256 w
    assert passed == math.ceil((256 - 20) * SHORT_FIRST_WEIGHT / 20)
    assert n == passed + 256 // 64 - 1  # then its four chunks, no short in between


def test_a_short_prompt_cuts_in_once_while_a_chunk_is_repaid(
    tiny_runner: ModelRunner, loop: asyncio.AbstractEventLoop
) -> None:
    """While a row runs and the decode steps still owe a long chunk's time, the next chunk waits
    but a prefill of one forward goes after one decode step, once; the next one waits for the
    repayment, as does the chunk."""
    scheduler = scripted(tiny_runner)
    admit(scheduler, loop, "stream", 20, 100)
    step(scheduler)
    long = admit(scheduler, loop, "long", 200, 1)
    step(scheduler)  # a first chunk
    assert scheduler.running and long.progress is not None
    scheduler._decode_owed = 1.0  # as if that chunk took a second and one decode step ran
    assert scheduler._prefill_turn() == []
    first = admit(scheduler, loop, "short-0", 20, 1)
    assert scheduler._prefill_turn() == [first]
    second = admit(scheduler, loop, "short-1", 20, 1)
    assert scheduler._prefill_turn() == []  # one cut-in per repayment
    scheduler._decode_owed = 0.0
    assert scheduler._prefill_turn() == [second]


def test_new_weights_restart_a_chunked_prefill_under_way(
    tiny_runner: ModelRunner, loop: asyncio.AbstractEventLoop
) -> None:
    """KV of the old weights must not serve a prompt: a prefill part-way through its chunks when
    new weights arrive starts over, and samples what an uninterrupted prefill samples."""
    runner = tiny_runner
    weights = {k: v.clone() for k, v in runner.model.state_dict().items()}
    scheduler = scripted(runner)

    def generate(rid: str, swap_after: int | None) -> list[int]:
        req = admit(scheduler, loop, rid, 200, 4)
        for n in range(50):
            if n == swap_after:
                assert req.progress is not None and req.progress.done == 2 * 64
                swap = NewWeights(
                    lambda: runner.swap_weights(weights),
                    "v2",
                    Reply(loop, loop.create_future()),
                )
                scheduler._control(swap, [])
                assert req.progress is None
            if not (scheduler.waiting or scheduler.running):
                return req.output
            step(scheduler)
        raise AssertionError("the request did not finish")

    assert generate("straight", None) == generate("restarted", 2)
