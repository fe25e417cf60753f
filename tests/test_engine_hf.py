"""The hf engine in-process on real models: outputs, logprob parity, batching, aborts, limits."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from tests.conftest import run_async, start_engine
from tokenwire.assets import prepare
from tokenwire.engine.base import (
    EngineError,
    EngineOutput,
    ImageInput,
    MultiModalInput,
    SamplingParams,
    SamplingSupport,
    TokenLogprob,
)
from tokenwire.engine.hf import HFEngine
from tokenwire.engine.hf.mrope import mrope_positions
from tokenwire.engine.hf.sampling import RowSampler, sample
from tokenwire.media.processing import MediaProcessor, expand_image_placeholders

FRANCE = "What is the capital of France?"


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish: str | None = None
    stop_reason: int | str | None = None
    outputs: int = 0
    cached: int = 0


async def collect(engine: HFEngine, rid: str, prompt: list[int], sp: SamplingParams) -> Result:
    res = Result()
    async for out in engine.generate(rid, prompt, sp):
        res.outputs += 1
        res.tokens += out.new_token_ids
        res.cached = out.num_cached_tokens or res.cached
        res.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            res.prompt_logprobs = out.prompt_logprobs
            assert out.num_prompt_tokens == len(prompt)
        res.finish = out.finish_reason
        assert out.stop_reason is None or out.finish_reason is not None  # final output only
        res.stop_reason = out.stop_reason
    return res


run = run_async  # one loop for all engine calls (see conftest)


@pytest.fixture(scope="module")
def engine(smol_dir: Path) -> Iterator[HFEngine]:
    """SmolLM2 on the session's engine (``--engine``): these checks hold for hf and vllm."""
    eng = start_engine(smol_dir, max_num_seqs=16)
    yield eng  # type: ignore[misc]
    run(eng.shutdown())


@pytest.fixture(scope="module")
def tiny_engine() -> Iterator[HFEngine]:
    """qwen3-tiny (random weights, flat distributions) with only two slots: queueing."""
    eng = start_engine(Path(prepare("qwen3-tiny")), max_num_seqs=2)
    yield eng  # type: ignore[misc]
    run(eng.shutdown())


def chat(tokenizer: AutoTokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@torch.inference_mode()
def full_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward over ``ids``: row t predicts ids[t + 1]."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_parity(model: torch.nn.Module, prompt: list[int], res: Result, k: int) -> None:
    """Each logprob equals one full forward of prompt + output within 1e-4; top-k sorted."""
    lp = full_logprobs(model, prompt + res.tokens[:-1])
    assert len(res.logprobs) == len(res.tokens)
    for j, (tok, tl) in enumerate(zip(res.tokens, res.logprobs, strict=True)):
        row = lp[len(prompt) - 1 + j]
        assert tl.token_id == tok
        assert abs(tl.logprob - float(row[tok])) < 1e-4
        higher = int((row > tl.logprob + 1e-4).sum())
        near = int((row > tl.logprob - 1e-4).sum())
        assert higher + 1 <= tl.rank <= near
        assert len(tl.top) == k
        values = [v for _, v in tl.top]
        assert values == sorted(values, reverse=True)
        ref_v, _ = torch.topk(row, k)
        for (tid, v), rv in zip(tl.top, ref_v.tolist(), strict=True):
            assert abs(v - rv) < 1e-4
            assert abs(float(row[tid]) - v) < 1e-4


def test_greedy_matches_hf_generate(
    engine: HFEngine, tokenizer: AutoTokenizer, ref_model: torch.nn.Module
) -> None:
    prompt = chat(tokenizer, FRANCE)
    res = run(collect(engine, "greedy", prompt, SamplingParams(max_tokens=24, temperature=0)))
    assert (
        tokenizer.decode(res.tokens, skip_special_tokens=True) == "The capital of France is Paris."
    )
    assert res.finish == "stop" and res.tokens[-1] == 2  # eos is part of the returned ids
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        ref = ref_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False
        )
    assert res.tokens == ref[0, len(prompt) :].tolist()


def test_logprobs_trainer_parity_with_mid_batch_joins(
    engine: HFEngine, tokenizer: AutoTokenizer, ref_model: torch.nn.Module
) -> None:
    prompts = [
        chat(tokenizer, "Write a haiku about autumn leaves."),
        chat(tokenizer, FRANCE),
        chat(tokenizer, "Explain in detail how a refrigerator keeps food cold, step by step."),
    ]
    params = [
        SamplingParams(max_tokens=14, temperature=0, logprobs=5, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7, logprobs=2),
        SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=3, logprobs=0),
    ]

    async def main() -> list[Result]:
        first = Result()
        started = asyncio.Event()

        async def lead() -> Result:
            async for out in engine.generate("par-0", prompts[0], params[0]):
                first.tokens += out.new_token_ids
                first.logprobs += out.logprobs or []
                first.finish = out.finish_reason
                if len(first.tokens) >= 3:
                    started.set()
            return first

        task = asyncio.create_task(lead())
        await started.wait()  # the others join a batch that is already decoding
        others = await asyncio.gather(
            collect(engine, "par-1", prompts[1], params[1]),
            collect(engine, "par-2", prompts[2], params[2]),
        )
        return [await task, *others]

    results = run(main())
    for prompt, sp, res in zip(prompts, params, results, strict=True):
        assert res.finish in ("stop", "length")
        assert_parity(ref_model, prompt, res, sp.logprobs or 0)
    assert all(tl.rank == 1 for tl in results[0].logprobs)  # greedy picks the argmax


def test_prompt_logprobs_equal_full_forward(
    engine: HFEngine, tokenizer: AutoTokenizer, ref_model: torch.nn.Module
) -> None:
    prompt = chat(tokenizer, FRANCE)
    sp = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    res = run(collect(engine, "plp", prompt, sp))
    plp = res.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    lp = full_logprobs(ref_model, prompt)
    for t in range(1, len(prompt)):
        entry = plp[t]
        assert entry is not None and entry.token_id == prompt[t]
        assert abs(entry.logprob - float(lp[t - 1, prompt[t]])) < 1e-4
        assert len(entry.top) == 3
        assert [i for i, _ in entry.top][:1] == [int(lp[t - 1].argmax())]


SAMPLING_MIX = [
    SamplingParams(max_tokens=8, temperature=0),
    SamplingParams(max_tokens=8, temperature=0.7, seed=1),
    SamplingParams(max_tokens=8, temperature=1.0, seed=2),
    SamplingParams(max_tokens=8, temperature=1.3, top_p=0.9, seed=3),
    SamplingParams(max_tokens=8, temperature=1.0, top_p=0.5, seed=4),
    SamplingParams(max_tokens=8, temperature=0.8, top_k=5, seed=5),
    SamplingParams(max_tokens=8, temperature=1.0, top_k=300, seed=6),  # > candidate set
    SamplingParams(max_tokens=8, temperature=1.0, min_p=0.1, seed=7),
    SamplingParams(max_tokens=8, temperature=1.2, min_p=0.02, top_p=0.95, top_k=40, seed=8),
    SamplingParams(max_tokens=8, temperature=0.9, repetition_penalty=1.3, seed=9),
    SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.5),
    SamplingParams(max_tokens=8, temperature=1.0, frequency_penalty=0.8, seed=10),
    SamplingParams(max_tokens=8, temperature=1.0, presence_penalty=1.0, top_p=0.8, seed=11),
    SamplingParams(
        max_tokens=8, temperature=0.8, seed=12, logprobs=3, logprobs_mode="processed_logprobs"
    ),
    SamplingParams(max_tokens=8, temperature=0.6, min_tokens=10, top_k=50, seed=13),
    SamplingParams(max_tokens=8, temperature=2.0, seed=14),
]


@pytest.mark.hf_only  # paced by the hf scheduler's step count
def test_concurrent_mixed_sampling_equals_alone(engine: HFEngine, tokenizer: AutoTokenizer) -> None:
    topics = ["rain", "chess", "volcanoes", "tea", "jazz", "rivers", "owls", "glass"]
    prompts = [chat(tokenizer, f"Tell me something about {topics[i % 8]}.") for i in range(16)]
    for i in range(0, 16, 2):  # vary lengths so rows are padded differently
        prompts[i] = chat(tokenizer, f"In a few words and quite informally: why {topics[i // 2]}?")

    async def alone() -> list[Result]:
        return [
            await collect(engine, f"alone-{i}", p, sp)
            for i, (p, sp) in enumerate(zip(prompts, SAMPLING_MIX, strict=True))
        ]

    async def together() -> list[Result]:
        first = [
            asyncio.create_task(collect(engine, f"mix-{i}", prompts[i], SAMPLING_MIX[i]))
            for i in range(8)
        ]
        while engine.stats().extra["steps"] < 3 and not all(t.done() for t in first):
            await asyncio.sleep(0.01)  # the second half joins a decoding batch
        second = [collect(engine, f"mix-{i}", prompts[i], SAMPLING_MIX[i]) for i in range(8, 16)]
        return [*(await asyncio.gather(*first)), *(await asyncio.gather(*second))]

    before = engine.stats().extra["steps"]
    solo = run(alone())
    mixed = run(together())
    assert engine.stats().extra["steps"] > before
    for i, (a, b) in enumerate(zip(solo, mixed, strict=True)):
        assert a.tokens == b.tokens, f"request {i} ({SAMPLING_MIX[i]})"
        assert a.finish == b.finish
    assert len(solo[14].tokens) == 8  # min_tokens kept eos away
    processed = solo[13].logprobs
    assert len(processed) == len(solo[13].tokens) and all(tl.logprob <= 0 for tl in processed)


def test_abort_by_id_keeps_partial_tokens_and_frees_slot(
    engine: HFEngine, tokenizer: AutoTokenizer
) -> None:
    prompt = chat(tokenizer, FRANCE)

    async def main() -> tuple[Result, bool]:
        res = Result()
        sp = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        async for out in engine.generate("to-abort", prompt, sp):
            res.tokens += out.new_token_ids
            res.finish = out.finish_reason
            if len(res.tokens) == 3:
                assert await engine.abort("to-abort")
        return res, await engine.abort("to-abort")

    res, again = run(main())
    assert res.finish == "abort"
    assert 3 <= len(res.tokens) < 200
    assert res.tokens[:7] == [504, 3575, 282, 4649, 314, 7042, 30][: len(res.tokens[:7])]
    assert not again  # the stream is over: nothing left to abort
    assert engine.stats().running == 0 and engine.stats().waiting == 0


def test_closing_the_stream_early_frees_the_slot(
    engine: HFEngine, tokenizer: AutoTokenizer
) -> None:
    prompt = chat(tokenizer, FRANCE)

    async def main() -> int:
        stream = engine.generate(
            "closed", prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        )
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(500):  # one decode step at most, even on a busy machine
            if engine.stats().running == 0:
                break
            await asyncio.sleep(0.01)
        return engine.stats().running

    assert run(main()) == 0
    # The id is free again.
    res = run(collect(engine, "closed", prompt, SamplingParams(max_tokens=2, temperature=0)))
    assert len(res.tokens) == 2


@pytest.mark.vllm_only  # the hf engine streams either way
def test_final_only_outputs_equal_the_streamed_ones_across_a_version_change(
    engine: HFEngine, tokenizer: AutoTokenizer
) -> None:
    """A final-only request (a non-streamed answer) gets the ids, logprobs and per-token
    weight versions a streamed one gets, in one output per version, when the version changes
    mid-request. Both wait in the paused engine, so they start in one step and keep pace."""
    prompt = chat(tokenizer, FRANCE)
    sp = SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True)
    made: dict[bool, list[EngineOutput]] = {False: [], True: []}

    async def one(final_only: bool) -> None:
        stream = engine.generate(f"final-only-{final_only}", prompt, sp, final_only=final_only)
        async for out in stream:
            made[final_only].append(out)

    async def main() -> None:
        await engine.pause("keep")
        tasks = [asyncio.create_task(one(final_only)) for final_only in (False, True)]
        await asyncio.sleep(0.5)  # both queued in the paused engine
        await engine.resume()
        while sum(len(out.new_token_ids) for out in made[False]) < 3:
            await asyncio.sleep(0.01)
        await engine.pause("keep")
        await engine.set_weight_version("final-only-v2")
        await engine.resume()
        await asyncio.gather(*tasks)

    try:
        run(main())
    finally:
        run(engine.set_weight_version("default"))
    streamed, final = made[False], made[True]

    def spans(outputs: list[EngineOutput]) -> list[tuple[str, int]]:
        merged: list[tuple[str, int]] = []
        for out in outputs:
            if merged and merged[-1][0] == out.weight_version:
                merged[-1] = (out.weight_version, merged[-1][1] + len(out.new_token_ids))
            elif out.new_token_ids:
                merged.append((out.weight_version, len(out.new_token_ids)))
        return merged

    assert [out.weight_version for out in final] == ["default", "final-only-v2"]
    assert spans(final) == spans(streamed) and 3 <= spans(final)[0][1] < 16
    assert [t for out in final for t in out.new_token_ids] == [
        t for out in streamed for t in out.new_token_ids
    ]
    pairs = zip(
        [lp for out in final for lp in out.logprobs or []],
        [lp for out in streamed for lp in out.logprobs or []],
        strict=True,
    )
    for a, b in pairs:  # one batch, two rows: equal up to the row's place in it
        assert (a.token_id, a.rank, [i for i, _ in a.top]) == (
            b.token_id,
            b.rank,
            [i for i, _ in b.top],
        )
        assert abs(a.logprob - b.logprob) < 1e-5
    assert (final[-1].finish_reason, final[0].num_prompt_tokens) == ("length", len(prompt))


def test_stop_conditions(engine: HFEngine, tokenizer: AutoTokenizer) -> None:
    prompt = chat(tokenizer, FRANCE)
    greedy = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris."<eos>

    async def main() -> list[Result]:
        return list(
            await asyncio.gather(
                collect(
                    engine,
                    "stop-id",
                    prompt,
                    SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(4649,)),
                ),
                collect(
                    engine,
                    "ignore-eos",
                    prompt,
                    SamplingParams(max_tokens=11, temperature=0, ignore_eos=True),
                ),
                collect(
                    engine,
                    "min-tokens",
                    prompt,
                    SamplingParams(max_tokens=12, temperature=0, min_tokens=10),
                ),
                collect(engine, "length", prompt, SamplingParams(max_tokens=3, temperature=0)),
                collect(
                    engine,
                    "min-stop",
                    prompt,
                    SamplingParams(
                        max_tokens=6, temperature=0, min_tokens=5, stop_token_ids=(4649,)
                    ),
                ),
            )
        )

    stop_id, ignore_eos, min_tokens, length, min_stop = run(main())
    assert stop_id.tokens == greedy[:4] and stop_id.finish == "stop"  # stop token included
    assert ignore_eos.tokens[:8] == greedy and len(ignore_eos.tokens) == 11
    assert ignore_eos.finish == "length"
    assert len(min_tokens.tokens) >= 10 and 2 not in min_tokens.tokens[:10]
    assert min_tokens.tokens[:7] == greedy[:7]
    assert min_tokens.finish == ("stop" if min_tokens.tokens[-1] == 2 else "length")
    assert length.tokens == greedy[:3] and length.finish == "length"
    assert 4649 not in min_stop.tokens[:5] and min_stop.tokens[:3] == greedy[:3]


def test_stop_reason_names_the_stop_token_id(engine: HFEngine, tokenizer: AutoTokenizer) -> None:
    """As vLLM: the stop_token_ids id that ended a choice; None for eos and length."""
    prompt = chat(tokenizer, FRANCE)
    greedy = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris."<eos>

    def sp(**changes: object) -> SamplingParams:
        return dataclasses.replace(SamplingParams(max_tokens=20, temperature=0), **changes)

    async def slow(rid: str, params: SamplingParams) -> Result:
        """A consumer that reads nothing after the first output until the engine has finished
        the request: the rest merges into one output, and the stop reason survives. The hf
        engine's stats say when it has; vLLM's count a request until its consumer has read the
        end, so there the wait is a bound (its core finishes five tokens well inside it)."""
        res = Result()
        async for out in engine.generate(rid, prompt, params):
            res.outputs += 1
            res.tokens += out.new_token_ids
            res.finish, res.stop_reason = out.finish_reason, out.stop_reason
            if res.outputs == 1:
                deadline = time.monotonic() + 5
                while engine.stats().running and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
        return res

    async def main() -> list[Result]:
        return list(
            await asyncio.gather(
                collect(engine, "sr-stop-id", prompt, sp(stop_token_ids=(4649,))),
                collect(engine, "sr-eos", prompt, sp()),
                collect(engine, "sr-length", prompt, sp(max_tokens=3)),
                collect(engine, "sr-eos-listed", prompt, sp(stop_token_ids=(2,))),
                collect(engine, "sr-eos-ignored", prompt, sp(stop_token_ids=(2,), ignore_eos=True)),
            )
        )

    stop_id, eos, length, eos_listed, eos_ignored = run(main())
    merged = run(slow("sr-merged", sp(stop_token_ids=(7042,))))
    assert stop_id.tokens == greedy[:4] and stop_id.finish == "stop"
    assert stop_id.stop_reason == 4649
    assert eos.tokens == greedy and eos.finish == "stop" and eos.stop_reason is None
    assert length.tokens == greedy[:3] and length.finish == "length"
    assert length.stop_reason is None
    # eos is checked first (vLLM's order): listing it as a stop id still reports eos.
    assert eos_listed.tokens == greedy and eos_listed.stop_reason is None
    # With ignore_eos it is only a stop id, and reported as one.
    assert eos_ignored.tokens == greedy and eos_ignored.finish == "stop"
    assert eos_ignored.stop_reason == 2
    assert merged.tokens == greedy[:6] and merged.outputs < len(merged.tokens)
    assert merged.finish == "stop" and merged.stop_reason == 7042


def test_max_num_seqs_queues_fifo(tiny_engine: HFEngine) -> None:
    prompts = [[100 + i, 200 + 7 * i, 300, 400 + i, 151644] for i in range(5)]
    params = [
        SamplingParams(max_tokens=6 + i, temperature=0.9, seed=i, ignore_eos=True) for i in range(5)
    ]

    async def alone() -> list[Result]:
        return [
            await collect(tiny_engine, f"q-alone-{i}", p, sp)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]

    async def together() -> tuple[list[Result], int]:
        tasks = [
            asyncio.create_task(collect(tiny_engine, f"q-{i}", p, sp))
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        most_waiting = 0
        while not all(t.done() for t in tasks):
            stats = tiny_engine.stats()
            assert stats.running <= 2
            most_waiting = max(most_waiting, stats.waiting)
            await asyncio.sleep(0.001)
        return [t.result() for t in tasks], most_waiting

    solo = run(alone())
    mixed, most_waiting = run(together())
    assert most_waiting >= 1
    for i, (a, b) in enumerate(zip(solo, mixed, strict=True)):
        assert a.tokens == b.tokens and len(b.tokens) == 6 + i and b.finish == "length"
    assert tiny_engine.stats().running == 0


def test_slow_consumer_gets_coalesced_outputs(tiny_engine: HFEngine) -> None:
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    prompt = [5, 6, 7, 8]

    async def slow() -> Result:
        res = Result()
        async for out in tiny_engine.generate("slow", prompt, sp):
            res.outputs += 1
            res.tokens += out.new_token_ids
            res.logprobs += out.logprobs or []
            res.finish = out.finish_reason
            await asyncio.sleep(0.2)  # the engine runs ahead; outputs pile up and merge
        return res

    fast = run(collect(tiny_engine, "fast", prompt, sp))
    res = run(slow())
    assert res.tokens == fast.tokens and res.finish == "length"
    assert [tl.token_id for tl in res.logprobs] == res.tokens
    assert res.outputs <= fast.outputs


def test_abort_while_queued(tiny_engine: HFEngine) -> None:
    async def main() -> list[Result]:
        sp = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        tasks = [
            asyncio.create_task(collect(tiny_engine, f"aq-{i}", [1, 2, 3 + i], sp))
            for i in range(3)
        ]
        while tiny_engine.stats().waiting < 1:
            await asyncio.sleep(0.001)
        for i in (2, 0, 1):
            await tiny_engine.abort(f"aq-{i}")
        return list(await asyncio.gather(*tasks))

    results = run(main())
    assert all(r.finish == "abort" for r in results)
    assert results[2].tokens == []  # it never left the queue
    assert tiny_engine.stats().running == 0 and tiny_engine.stats().waiting == 0


def test_rejects_what_is_the_engines_to_check(engine: HFEngine, tokenizer: AutoTokenizer) -> None:
    prompt = chat(tokenizer, FRANCE)

    async def first(rid: str, ids: list[int], sp: SamplingParams, media: object = None) -> None:
        async for _ in engine.generate(rid, ids, sp, media):
            break

    with pytest.raises(EngineError, match="no image input"):
        run(first("media", prompt, SamplingParams(max_tokens=1), media={"pixel_values": 1}))

    async def duplicate() -> None:
        sp = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        stream = engine.generate("dup", prompt, sp)
        await stream.__anext__()
        try:
            with pytest.raises(EngineError, match="already running"):
                await first("dup", prompt, sp)
        finally:
            await stream.aclose()

    run(duplicate())
    assert engine.vocab_size == 49152 and engine.model_name == "smollm2-135m-instruct"
    assert engine.is_ready()


def _sorted_pick(scaled: torch.Tensor, p: SamplingParams, u: float) -> int:
    """Reference: full sort, vLLM's min_p -> top_k -> top_p, inverse CDF in sorted order.

    Returns the pick's position in the sorted order (ties and rounding aside, the same token).
    """
    if p.min_p > 0:
        scaled = scaled.masked_fill(scaled < scaled.max() + math.log(p.min_p), float("-inf"))
    vals = torch.sort(scaled, descending=True).values
    keep = torch.isfinite(vals)
    if 0 < p.top_k < scaled.shape[-1]:
        keep[p.top_k :] = False
    probs = torch.softmax(vals.masked_fill(~keep, float("-inf")), dim=-1).double()
    keep &= (probs.cumsum(-1) - probs) < p.top_p
    kept_cum = (probs * keep).cumsum(-1)
    pick = int(torch.searchsorted(kept_cum, kept_cum[-1:] * u, right=True).item())
    return min(pick, int(keep.sum()) - 1)


def _vocab_order_pick(scaled: torch.Tensor, min_p: float, u: float) -> int:
    """Reference for rows with neither top_k nor top_p: inverse CDF in vocabulary order."""
    if min_p > 0:
        scaled = scaled.masked_fill(scaled < scaled.max() + math.log(min_p), float("-inf"))
    cum = torch.softmax(scaled.double(), dim=-1).cumsum(dim=-1)
    return int(torch.searchsorted(cum, cum[-1:] * u, right=True).item())


@pytest.mark.hf_only
@pytest.mark.parametrize("seed", range(4))
def test_candidate_sampling_matches_exact_path(seed: int) -> None:
    """The candidate tiers pick what a full sort picks for the same draw."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 5000
    logits = torch.randn(9, vocab, generator=gen) * (1.0 + 3.0 * seed)
    mix = [
        SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9),
        SamplingParams(max_tokens=1, temperature=1.0, top_k=7),
        SamplingParams(max_tokens=1, temperature=1.0, top_k=600),
        SamplingParams(max_tokens=1, temperature=1.0, min_p=0.3),
        SamplingParams(max_tokens=1, temperature=1.5, min_p=0.05, top_p=0.7),
        SamplingParams(max_tokens=1, temperature=0.5, top_k=100, top_p=0.95),
        SamplingParams(max_tokens=1, temperature=1.0, top_p=0.999),
        SamplingParams(max_tokens=1, temperature=1.0, top_k=3, min_p=0.2),
        SamplingParams(max_tokens=1, temperature=0.7),
    ]
    for trial in range(5):
        seeds = [1000 * trial + j for j in range(len(mix))]
        rows = [
            RowSampler.create(dataclasses.replace(sp, seed=s), [1], (), vocab, torch.device("cpu"))
            for sp, s in zip(mix, seeds, strict=True)
        ]
        draws = [
            torch.rand(1, generator=torch.Generator().manual_seed(s), dtype=torch.float64).item()
            for s in seeds
        ]
        got = sample(logits, rows).token_ids
        for j, sp in enumerate(mix):
            scaled = logits[j] / sp.temperature
            if sp.top_k == 0 and sp.top_p >= 1.0:
                assert got[j] == _vocab_order_pick(scaled, sp.min_p, draws[j]), (sp, trial)
                continue
            # Float rounding may move a draw that sits on a boundary to the neighbouring token.
            position = int((torch.sort(scaled, descending=True).indices == got[j]).nonzero())
            assert abs(position - _sorted_pick(scaled, sp, draws[j])) <= 1, (sp, trial)


@pytest.mark.hf_only
def test_sampling_supports_are_what_each_row_drew_from() -> None:
    """``sampling_mask`` rows report the ids left after top-k / top-p / min-p (the sampled one
    among them) and its logprob over them; other rows report nothing and sample the same ids."""
    gen = torch.Generator().manual_seed(7)
    vocab = 5000
    logits = torch.randn(6, vocab, generator=gen) * 4.0
    logits[5, 10] = 60.0  # one token holds all but ~1e-20 of the mass: top_p 1 still keeps 5
    mix = [
        SamplingParams(max_tokens=1, temperature=1.0, top_k=5),
        SamplingParams(max_tokens=1, temperature=0.8, top_k=50, top_p=0.7),
        SamplingParams(max_tokens=1, temperature=1.0, top_k=300, min_p=0.05),
        SamplingParams(max_tokens=1, temperature=0.0, top_k=5),  # greedy: the argmax alone
        SamplingParams(max_tokens=1, temperature=1.0, top_k=2048, top_p=0.9),
        SamplingParams(max_tokens=1, temperature=1.0, top_k=5),
    ]

    def rows(mask: bool) -> list[RowSampler]:
        return [
            RowSampler.create(
                dataclasses.replace(sp, seed=j, sampling_mask=mask),
                [1],
                (),
                vocab,
                torch.device("cpu"),
            )
            for j, sp in enumerate(mix)
        ]

    plain, masked = sample(logits, rows(False)), sample(logits, rows(True))
    assert plain.token_ids == masked.token_ids and plain.supports == [None] * len(mix)
    for j, (sp, token, support) in enumerate(
        zip(mix, masked.token_ids, masked.supports, strict=True)
    ):
        assert support is not None and token in support.token_ids
        assert list(support.token_ids) == sorted(support.token_ids)
        if sp.temperature == 0:
            assert support == SamplingSupport((token,), 0.0)
            continue
        probs = torch.softmax(logits[j].double() / sp.temperature, dim=-1)
        order = torch.argsort(probs, descending=True)
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[order[: sp.top_k]] = True
        keep &= probs >= sp.min_p * probs.max()
        mass = probs * keep
        before = mass[order].cumsum(0) - mass[order]
        if sp.top_p < 1.0:
            keep[order[before / mass.sum() >= sp.top_p]] = False
        assert set(support.token_ids) == set(keep.nonzero().flatten().tolist()), sp
        expected = math.log(probs[token] / probs[keep].sum())
        assert abs(support.logprob - expected) < 1e-6, sp
    assert len(masked.supports[0].token_ids) == len(masked.supports[5].token_ids) == 5


@pytest.mark.hf_only
def test_logprob_token_ids_take_the_place_of_the_top_k() -> None:
    """vLLM's ``logprob_token_ids``: the given ids' logprobs, in their order, at every step."""
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(3))
    given = (7, 250, 3)
    params = [
        SamplingParams(max_tokens=1, temperature=0.0, logprobs=3, logprob_token_ids=given),
        SamplingParams(max_tokens=1, temperature=0.0, logprobs=2),
    ]
    rows = [RowSampler.create(p, [1], (), 300, torch.device("cpu")) for p in params]
    result = sample(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    scored, top = result.logprobs
    assert scored is not None and top is not None
    assert [i for i, _ in scored.top] == list(given)
    for token_id, logprob in scored.top:
        assert abs(logprob - reference[0, token_id].item()) < 1e-6
    assert [i for i, _ in top.top] == torch.topk(reference[1], 2).indices.tolist()


@pytest.mark.hf_only
def test_padded_cache_join_decode_drop_trim() -> None:
    """Rows keep their own tokens, right-aligned, through joins, in-place decodes and drops."""
    from tokenwire.engine.hf.kv_cache import PaddedBatchCache

    cache = PaddedBatchCache(num_layers=2, device=torch.device("cpu"))
    order: list[str] = []  # cache row -> request name
    tokens: dict[str, list[float]] = {}

    def join(named: dict[str, int]) -> None:
        width = max(named.values())
        kv = torch.zeros(len(named), 1, width, 2)
        mask = torch.zeros(len(named), width, dtype=torch.bool)
        for r, (name, n) in enumerate(named.items()):
            tokens[name] = [1000.0 * (len(tokens) + 1) + t for t in range(n)]
            kv[r, 0, width - n :, 0] = torch.tensor(tokens[name])
            mask[r, width - n :] = True
            order.append(name)
        cache.join([(kv, kv + 0.5), (kv, kv + 0.5)], mask, rows_cap=8)

    def decode() -> None:
        cache.begin_decode()
        new = torch.zeros(len(order), 1, 1, 2)
        for r, name in enumerate(order):
            tokens[name].append(tokens[name][-1] + 1)
            new[r, 0, 0, 0] = tokens[name][-1]
        for layer in range(2):
            keys, _ = cache.update(new, new + 0.5, layer)
            assert keys.shape[2] == cache.length + 1
        cache.commit(1)

    def drop(*names: str) -> None:
        moves = cache.drop([order.index(n) for n in names])
        for src, dst in moves:
            order[dst] = order[src]
        del order[len(order) - len(names) :]

    def check() -> None:
        mask = cache.window_mask()
        assert mask.shape == (len(order), cache.length)
        for layer in cache.layers:
            for r, name in enumerate(order):
                got = layer.keys[r, 0, :, 0][mask[r]].tolist() if cache.length else []
                assert got == tokens[name]
                values = layer.values[r, 0, :, 0][mask[r]] if cache.length else torch.zeros(0)
                assert values.tolist() == [t + 0.5 for t in tokens[name]]
                assert mask[r, -1]  # right-aligned
        assert bool(mask.any(dim=0)[0]) or not order  # no all-padding leading column

    join({"a": 3})
    decode()
    decode()
    check()
    join({"b": 9, "c": 2})  # longer than the window: grows left
    decode()
    check()
    join({"d": 4})
    decode()
    check()
    drop("a")
    decode()
    check()
    drop("b")  # the longest row goes: leading padding is trimmed
    assert cache.length == max(len(tokens[n]) for n in order)
    decode()
    check()
    for _ in range(80):  # past the first column capacity: the buffers grow
        decode()
    check()
    drop("c", "d")
    assert cache.rows == 0 and cache.length == 0
    join({"e": 5, "f": 1})
    decode()
    check()


# -- multimodal: qwen2-vl-tiny ------------------------------------------------------------------

VL_MERGE = 2


@pytest.fixture(scope="module")
def vl_dir() -> Path:
    return Path(prepare("qwen2-vl-tiny"))


@pytest.fixture(scope="module")
def vl_engine(vl_dir: Path) -> Iterator[HFEngine]:
    eng = start_engine(vl_dir, max_num_seqs=8)
    yield eng  # type: ignore[misc]
    run(eng.shutdown())


@pytest.fixture(scope="module")
def vl_model(vl_dir: Path) -> torch.nn.Module:
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vl_parts(vl_dir: Path) -> tuple[AutoTokenizer, MediaProcessor]:
    processor = MediaProcessor.from_model_dir(vl_dir)
    assert processor is not None and processor.merge_size == VL_MERGE
    return AutoTokenizer.from_pretrained(vl_dir), processor


def solid(width: int, height: int, rgb: tuple[int, int, int]) -> Image.Image:
    return Image.new("RGB", (width, height), rgb)


def gradient(width: int, height: int) -> Image.Image:
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    y = np.linspace(255, 0, height, dtype=np.float32)[:, None, None]
    pixels = np.concatenate([x + 0 * y, y + 0 * x, (x + y) / 2], axis=2).astype(np.uint8)
    return Image.fromarray(pixels)


def vl_prompt(
    parts: tuple[AutoTokenizer, MediaProcessor], text: str, images: list[Image.Image]
) -> tuple[list[int], MultiModalInput]:
    """Chat ids with each image's pad expanded, and the media the api layer would pass."""
    tok, processor = parts
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    ids = list(tok.apply_chat_template([{"role": "user", "content": content}], **GEN)["input_ids"])
    items = [processor.process_image(img) for img in images]
    expanded, ranges = expand_image_placeholders(
        ids, VL_PAD, [i.num_placeholder_tokens for i in items]
    )
    media = MultiModalInput(
        tuple(
            ImageInput(i.pixel_values, i.image_grid_thw, offset, length)
            for i, (offset, length) in zip(items, ranges, strict=True)
        )
    )
    return expanded, media


GEN = {"add_generation_prompt": True}
VL_PAD = 151655


async def collect_mm(
    engine: HFEngine,
    rid: str,
    prompt: list[int],
    sp: SamplingParams,
    media: MultiModalInput | None,
) -> Result:
    res = Result()
    async for out in engine.generate(rid, prompt, sp, media):
        res.outputs += 1
        res.tokens += out.new_token_ids
        res.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            res.prompt_logprobs = out.prompt_logprobs
        res.finish = out.finish_reason
    return res


def media_kwargs(media: MultiModalInput | None) -> dict[str, torch.Tensor]:
    if media is None or not media.images:
        return {}
    return {
        "pixel_values": torch.cat([im.pixel_values for im in media.images]),
        "image_grid_thw": torch.cat([im.image_grid_thw.reshape(1, 3) for im in media.images]),
    }


@torch.inference_mode()
def vl_full_logprobs(
    model: torch.nn.Module, ids: list[int], media: MultiModalInput | None
) -> torch.Tensor:
    """Trainer view: one forward over ``ids`` with pixel values and explicit 3D positions."""
    images = media.images if media is not None else ()
    positions, _ = mrope_positions(
        len(ids),
        [(im.offset, im.length) for im in images],
        [tuple(int(v) for v in im.image_grid_thw.reshape(-1)) for im in images],
        VL_MERGE,
    )
    out = model(
        input_ids=torch.tensor([ids]), position_ids=positions[:, None], **media_kwargs(media)
    )
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def assert_vl_parity(
    model: torch.nn.Module, prompt: list[int], media: MultiModalInput | None, res: Result, k: int
) -> None:
    lp = vl_full_logprobs(model, prompt + res.tokens[:-1], media)
    assert [tl.token_id for tl in res.logprobs] == res.tokens
    for j, (tok, tl) in enumerate(zip(res.tokens, res.logprobs, strict=True)):
        row = lp[len(prompt) - 1 + j]
        assert abs(tl.logprob - float(row[tok])) < 1e-4, j
        ref_v, _ = torch.topk(row, k)
        assert len(tl.top) == k
        for (tid, v), rv in zip(tl.top, ref_v.tolist(), strict=True):
            assert abs(v - rv) < 1e-4 and abs(float(row[tid]) - v) < 1e-4


def test_vl_image_greedy_matches_hf_generate_and_full_forward(
    vl_engine: HFEngine,
    vl_model: torch.nn.Module,
    vl_parts: tuple[AutoTokenizer, MediaProcessor],
) -> None:
    images = [gradient(112, 84), solid(56, 56, (200, 30, 30))]  # two images: order matters
    prompt, media = vl_prompt(vl_parts, "Describe both pictures.", images)
    assert [im.length for im in media.images] == [12, 4]
    sp = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    res = run(collect_mm(vl_engine, "vl-greedy", prompt, sp, media))
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        vl_model.model.rope_deltas = None
        ref = vl_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=(ids == VL_PAD).long(),
            max_new_tokens=12,
            do_sample=False,
            **media_kwargs(media),
        )
        vl_model.model.rope_deltas = None
    assert res.tokens == ref[0, len(prompt) :].tolist()
    assert_vl_parity(vl_model, prompt, media, res, 3)
    # The engine never leans on the module's hidden M-RoPE state.
    assert vl_engine._runner.model.model.rope_deltas is None

    plp = run(
        collect_mm(
            vl_engine, "vl-plp", prompt, SamplingParams(max_tokens=1, prompt_logprobs=2), media
        )
    ).prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    lp = vl_full_logprobs(vl_model, prompt, media)
    for t in range(1, len(prompt)):
        entry = plp[t]
        assert entry is not None and abs(entry.logprob - float(lp[t - 1, prompt[t]])) < 1e-4


def test_vl_image_and_text_rows_batch_like_alone(
    vl_engine: HFEngine,
    vl_model: torch.nn.Module,
    vl_parts: tuple[AutoTokenizer, MediaProcessor],
) -> None:
    tok, _ = vl_parts
    text_a = list(
        tok.apply_chat_template([{"role": "user", "content": "Tell me about rain."}], **GEN)[
            "input_ids"
        ]
    )
    text_b = list(
        tok.apply_chat_template([{"role": "user", "content": "Why?"}], **GEN)["input_ids"]
    )
    img_c, media_c = vl_prompt(vl_parts, "What colour?", [solid(84, 56, (20, 40, 220))])
    img_d, media_d = vl_prompt(vl_parts, "What colour?", [gradient(84, 56)])
    assert img_c == img_d  # same ids, different pixels
    greedy = SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)
    reqs: list[tuple[list[int], SamplingParams, MultiModalInput | None]] = [
        (text_a, greedy, None),
        (img_c, greedy, media_c),
        (text_b, SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True), None),
        (img_d, greedy, media_d),
        (text_b, greedy, MultiModalInput(())),  # no images: a plain text row
    ]

    async def alone() -> list[Result]:
        return [
            await collect_mm(vl_engine, f"vl-alone-{i}", p, sp, m)
            for i, (p, sp, m) in enumerate(reqs)
        ]

    async def together() -> list[Result]:
        first = asyncio.create_task(collect_mm(vl_engine, "vl-mix-0", *reqs[0]))
        while vl_engine.stats().running < 1 and not first.done():
            await asyncio.sleep(0.005)  # the rest join a batch that is already decoding
        rest = [collect_mm(vl_engine, f"vl-mix-{i}", *r) for i, r in enumerate(reqs) if i]
        return [await first, *(await asyncio.gather(*rest))]

    solo = run(alone())
    mixed = run(together())
    for i, (a, b) in enumerate(zip(solo, mixed, strict=True)):
        assert a.tokens == b.tokens and len(a.tokens) == 10, i
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x.logprob - y.logprob) < 1e-4, i
    for i in (0, 1, 3, 4):
        assert_vl_parity(vl_model, reqs[i][0], reqs[i][2], mixed[i], 2)
    # Two different images: different distributions.
    c, d = mixed[1].logprobs[0], mixed[3].logprobs[0]
    assert c.top != d.top or abs(c.logprob - d.logprob) > 1e-3
    assert vl_engine.stats().running == 0


def test_vl_abort_and_close_media_requests(
    vl_engine: HFEngine, vl_parts: tuple[AutoTokenizer, MediaProcessor]
) -> None:
    prompt, media = vl_prompt(vl_parts, "Go on.", [gradient(56, 112)])
    sp = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)

    async def main() -> tuple[Result, int]:
        res = Result()
        async for out in vl_engine.generate("vl-abort", prompt, sp, media):
            res.tokens += out.new_token_ids
            res.finish = out.finish_reason
            if len(res.tokens) == 3:
                assert await vl_engine.abort("vl-abort")
        stream = vl_engine.generate("vl-close", prompt, sp, media)
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(500):
            if vl_engine.stats().running == 0:
                break
            await asyncio.sleep(0.01)
        return res, vl_engine.stats().running

    res, running = run(main())
    assert res.finish == "abort" and 3 <= len(res.tokens) < 300
    assert running == 0
    again = run(collect_mm(vl_engine, "vl-close", prompt, SamplingParams(max_tokens=2), media))
    assert len(again.tokens) == 2


def test_vl_rejects_bad_media(
    vl_engine: HFEngine,
    tiny_engine: HFEngine,
    vl_parts: tuple[AutoTokenizer, MediaProcessor],
) -> None:
    prompt, media = vl_prompt(vl_parts, "Hi", [solid(56, 56, (0, 0, 0)), gradient(56, 56)])
    one, two = media.images
    assert (one.length, two.length) == (4, 4)
    sp = SamplingParams(max_tokens=1)
    # One more pad id outside every image's range.
    extra_pad = prompt[:-1] + [VL_PAD]

    async def first(engine: HFEngine, ids: list[int], m: object) -> None:
        async for _ in engine.generate("bad", ids, sp, m):  # type: ignore[arg-type]
            break

    def swap(im: ImageInput, **kw: object) -> ImageInput:
        return dataclasses.replace(im, **kw)

    nan_pixels = one.pixel_values.clone()
    nan_pixels[0, 0] = float("nan")
    cases: list[tuple[list[int], object, str]] = [
        (prompt, {"pixel_values": 1}, "MultiModalInput"),
        (prompt, MultiModalInput((swap(one, offset=len(prompt) - 2), two)), "outside the prompt"),
        (prompt, MultiModalInput((two, one)), "prompt order"),
        (prompt, MultiModalInput((swap(one, offset=one.offset - 1), two)), "other than the image"),
        (prompt, MultiModalInput((one,)), "image tokens but the images fill 4"),
        (extra_pad, media, "holds 9 image tokens"),
        (prompt, MultiModalInput((one, swap(two, length=3))), "makes 4 image tokens"),
        (prompt, MultiModalInput((swap(one, pixel_values=one.pixel_values[:8]), two)), "has shape"),
        (
            prompt,
            MultiModalInput((swap(one, image_grid_thw=torch.tensor([[1, 3, 4]])), two)),
            "multiples of the merge size",
        ),
        (prompt, MultiModalInput((swap(one, image_grid_thw=torch.ones(1, 3)), two)), "integer"),
        (prompt, MultiModalInput((swap(one, pixel_values=one.pixel_values[:, :10]), two)), "shape"),
        (prompt, MultiModalInput((swap(one, pixel_values=nan_pixels), two)), "finite"),
        (prompt, MultiModalInput((swap(one, offset=1.5), two)), "ints"),
    ]
    for ids, bad, message in cases:
        with pytest.raises(EngineError, match=message):
            run(first(vl_engine, ids, bad))
    with pytest.raises(EngineError, match="this model takes no image input"):
        run(first(tiny_engine, [1, 2, 3], media))
    assert vl_engine.multimodal and not tiny_engine.multimodal
    # Nothing reached the engine thread; it still serves images and text.
    assert vl_engine.stats().running == 0 and vl_engine.stats().waiting == 0
    assert len(run(collect_mm(vl_engine, "ok", prompt, sp, media)).tokens) == 1
    assert len(run(collect_mm(vl_engine, "ok", [1, 2, 3], sp, None)).tokens) == 1


def test_values_beyond_float32_never_fail_the_batch(tiny_engine: HFEngine) -> None:
    """Sampling values past what the protocol allows reach the engine beside innocent requests:
    every request finishes normally (the guard the 400s of the protocol stand in front of)."""
    poison = [
        SamplingParams(max_tokens=6, temperature=1e308, top_k=5, ignore_eos=True),
        SamplingParams(max_tokens=6, repetition_penalty=1e308, top_k=5, ignore_eos=True),
        SamplingParams(max_tokens=6, repetition_penalty=1e-45, top_p=0.5, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.8, top_p=5e-324, ignore_eos=True),
    ]
    innocent = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)

    async def main() -> tuple[list[Result], list[Result]]:
        alone = await collect(tiny_engine, "alone", [1, 2, 3], innocent)
        both = await asyncio.gather(
            *(collect(tiny_engine, f"poison-{i}", [1, 2, 3], p) for i, p in enumerate(poison)),
            *(collect(tiny_engine, f"innocent-{i}", [1, 2, 3], innocent) for i in range(2)),
        )
        return [alone], list(both)

    alone, results = run(main())
    assert all(r.finish == "length" and len(r.tokens) == 6 for r in results)
    for r in results[len(poison) :]:
        assert r.tokens == alone[0].tokens  # greedy neighbours are untouched


@pytest.mark.hf_only
def test_prefix_cache_on_and_off_give_the_same_tokens(
    engine: HFEngine, smol_dir: Path, tokenizer: AutoTokenizer, ref_model: torch.nn.Module
) -> None:
    """Greedy and seeded requests of one prompt and a second turn on top of the first (which
    reuses the first turn's blocks) give the ids of an engine without the cache, with parity;
    seeded requests store blocks but never read them."""
    off = HFEngine(smol_dir, max_num_seqs=16, device="cpu", prefix_cache_bytes=0)
    run(off.start())
    try:
        prompt = chat(tokenizer, "Tell me about the sea. " * 20)  # several 16-token blocks
        greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)

        def seeded(seed: int) -> SamplingParams:
            return SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)

        async def group(eng: HFEngine, tag: str, ids: list[int]) -> list[Result]:
            return list(
                await asyncio.gather(
                    collect(eng, f"{tag}-g", ids, greedy),
                    *(collect(eng, f"{tag}-{s}", ids, seeded(s)) for s in range(2)),
                )
            )

        turns: dict[str, list[list[Result]]] = {}
        for tag, eng in (("on", engine), ("off", off)):
            first = run(group(eng, f"{tag}1", prompt))
            second = prompt + first[0].tokens + chat(tokenizer, "And about rivers?")
            turns[tag] = [first, run(group(eng, f"{tag}2", second))]
        for on, off_ in zip(turns["on"], turns["off"], strict=True):
            assert [r.tokens for r in on] == [r.tokens for r in off_]
        assert_parity(ref_model, prompt, turns["on"][0][0], 3)
        second = prompt + turns["on"][0][0].tokens + chat(tokenizer, "And about rivers?")
        assert_parity(ref_model, second, turns["on"][1][0], 3)
        stats = engine.stats().extra
        assert stats["prefix_cache_hits"] >= 1 and stats["prefix_cache_bytes"] > 0
        assert all(r.cached == 0 for turn in turns["on"] for r in turn[1:])
        assert off.stats().extra["prefix_cache_hits"] == 0
    finally:
        run(off.shutdown())


@pytest.mark.hf_only
def test_prefix_cache_blocks_segments_and_lru_eviction() -> None:
    """Blocks are shared by prefix, a hit concatenates a path of segments, and eviction takes the
    least recently used leaf (with what follows it) but never what a new segment follows."""
    from tokenwire.engine.hf.prefix_cache import BLOCK_TOKENS, PrefixCache, RowKV, block_keys

    def row(tokens: list[int]) -> RowKV:
        # One layer, one head, head_dim 1: the value at token t is the token id (4 bytes each).
        kv = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1)
        return RowKV([(kv, kv)], 0, torch.arange(len(tokens)))

    block_bytes = 2 * 4 * BLOCK_TOKENS
    cache = PrefixCache(budget_bytes=6 * block_bytes)
    a = list(range(3 * BLOCK_TOKENS))
    a2 = [*a, *range(500, 500 + BLOCK_TOKENS)]  # a's turn 2
    b = [*range(1000, 1000 + 2 * BLOCK_TOKENS)]
    cache.keep(block_keys(a), len(a), lambda: row(a))
    cache.keep(block_keys(a2), len(a2), lambda: row(a2))
    assert cache.bytes == 4 * block_bytes  # a2 added one block after a's three
    assert cache.match(block_keys([*a2, 7])) == 4
    assert cache.fetch(block_keys(a2))[0][0].flatten().tolist() == [float(t) for t in a2]
    assert block_keys(a2)[:3] == block_keys(a)
    cache.keep(block_keys(b), len(b), lambda: row(b))  # fits: 6 blocks
    cache.fetch(block_keys(a2))  # a2 (and a under it) are now more recent than b
    c = [*range(2000, 2000 + BLOCK_TOKENS)]
    cache.keep(block_keys(c), len(c), lambda: row(c))  # evicts b (the oldest leaf), whole
    assert cache.match(block_keys(b)) == 0 and cache.match(block_keys(a2)) == 4
    assert cache.bytes == 5 * block_bytes and cache.evicted_bytes == 2 * block_bytes
    d = [*a, *range(3000, 3000 + 3 * BLOCK_TOKENS)]  # follows a: a is kept, c and a2's tail go
    cache.keep(block_keys(d), len(d), lambda: row(d))
    assert cache.match(block_keys(d)) == 6 and cache.match(block_keys(a2)) == 3
    assert cache.match(block_keys(c)) == 0 and cache.bytes == 6 * block_bytes
    cache.keep(block_keys(b), len(b) + 1, lambda: row(b))  # KV of another length: not kept
    assert cache.match(block_keys(b)) == 0
    cache.clear()
    assert cache.bytes == 0 and cache.match(block_keys(d)) == 0
