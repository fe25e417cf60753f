"""Structured outputs on the hf engine with qwen3-tiny's random weights (flat distributions,
the hardest case for a constraint): sampled outputs under a JSON schema parse and validate, a
regex and a choice hold, free rows of the same batch are untouched, and a constrained token's
logprob is the model's raw one (a transformers forward, 1e-4) or, in processed mode, the
masked distribution's."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema_rs
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import run_async, start_engine
from tokenwire.assets import prepare
from tokenwire.engine.base import SamplingParams, TokenLogprob
from tokenwire.engine.hf import HFEngine
from tokenwire.structured.grammar import CompiledGrammar, GrammarCompiler
from tokenwire.structured.spec import constraint_of

pytestmark = pytest.mark.hf_only

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "ok"],
    "additionalProperties": False,
}
N = 50
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def qwen3_dir() -> Path:
    return Path(prepare("qwen3-tiny"))


@pytest.fixture(scope="module")
def engine(qwen3_dir: Path) -> Iterator[HFEngine]:
    eng = start_engine(qwen3_dir, max_num_seqs=32)
    yield eng  # type: ignore[misc]
    run_async(eng.shutdown())


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir: Path) -> AutoTokenizer:
    return AutoTokenizer.from_pretrained(str(qwen3_dir))


@pytest.fixture(scope="module")
def compiler(engine: HFEngine, tokenizer: AutoTokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, engine.vocab_size, engine.eos_token_ids)


def compiled(compiler: GrammarCompiler, fields: dict) -> CompiledGrammar:
    return run_async(compiler.compile(constraint_of(fields)))


async def _collect(
    engine: HFEngine, rid: str, prompt: list[int], sp: SamplingParams
) -> tuple[list[int], list[TokenLogprob], str | None]:
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    finish = None
    async for out in engine.generate(rid, prompt, sp):
        tokens += out.new_token_ids
        logprobs += out.logprobs or []
        finish = out.finish_reason
    return tokens, logprobs, finish


def _many(engine: HFEngine, prompt: list[int], params: list[SamplingParams]) -> list:
    async def go() -> list:
        return await asyncio.gather(
            *(_collect(engine, f"s{i}-{id(p)}", prompt, p) for i, p in enumerate(params))
        )

    return run_async(go())


def _text(tokenizer: AutoTokenizer, tokens: list[int], eos: tuple[int, ...]) -> str:
    return tokenizer.decode([t for t in tokens if t not in eos])


def test_json_schema_outputs_parse_and_validate(
    engine: HFEngine, tokenizer: AutoTokenizer, compiler: GrammarCompiler
) -> None:
    grammar = compiled(compiler, {"json": SCHEMA})
    prompt = tokenizer.encode("A person as JSON:")
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, grammar=grammar) for _ in range(N)
    ]
    # Free rows in the same batch: they sample what they sample alone (seeded).
    free = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    results = _many(engine, prompt, [*params, free])
    alone = _many(engine, prompt, [free])
    assert results[-1][0] == alone[0][0]
    validator = jsonschema_rs.validator_for(SCHEMA)
    for tokens, _, finish in results[:-1]:
        text = _text(tokenizer, tokens, engine.eos_token_ids)
        assert finish == "stop", (finish, text)
        validator.validate(json.loads(text))


def test_regex_and_choice(
    engine: HFEngine, tokenizer: AutoTokenizer, compiler: GrammarCompiler
) -> None:
    prompt = tokenizer.encode("Answer:")
    regex = compiled(compiler, {"regex": r"[A-Z][a-z]{2,5}-[0-9]{3}"})
    choice = compiled(compiler, {"choice": ["north", "south", "east by west"]})
    params = [SamplingParams(max_tokens=40, temperature=1.0, grammar=regex)] * 10 + [
        SamplingParams(max_tokens=40, temperature=1.0, grammar=choice)
    ] * 10
    results = _many(engine, prompt, params)
    for tokens, _, finish in results[:10]:
        text = _text(tokenizer, tokens, engine.eos_token_ids)
        assert finish == "stop" and re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{3}", text), text
    for tokens, _, finish in results[10:]:
        text = _text(tokenizer, tokens, engine.eos_token_ids)
        assert finish == "stop" and text in ("north", "south", "east by west"), text


def test_seeded_constrained_request_is_reproducible(
    engine: HFEngine, tokenizer: AutoTokenizer, compiler: GrammarCompiler
) -> None:
    grammar = compiled(compiler, {"json": SCHEMA})
    prompt = tokenizer.encode("A person as JSON:")
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=5, grammar=grammar)
    others = [SamplingParams(max_tokens=30, temperature=1.0)] * 6
    alone = _many(engine, prompt, [sp])[0][0]
    crowded = _many(engine, prompt, [*others, sp])[-1][0]
    assert alone == crowded


def test_constrained_logprobs_raw_and_processed(
    engine: HFEngine, tokenizer: AutoTokenizer, compiler: GrammarCompiler, qwen3_dir: Path
) -> None:
    """raw: a transformers forward of prompt + output (1e-4); processed: that forward's row
    masked by the grammar at each step, renormalised (temperature 1, no filters)."""
    grammar = compiled(compiler, {"json": SCHEMA})
    prompt = tokenizer.encode("A person as JSON:")
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, logprobs=0, grammar=grammar)
    processed_sp = dataclasses.replace(sp, logprobs_mode="processed_logprobs")
    (tokens, raw, _), (tokens2, processed, _) = _many(engine, prompt, [sp, processed_sp])
    assert tokens == tokens2  # the mode changes the report, not the draw
    model = AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0].float()
    full = torch.log_softmax(logits, dim=-1)
    state = grammar.new_state()
    for j, (token, r, p) in enumerate(zip(tokens, raw, processed, strict=True)):
        row = len(prompt) - 1 + j
        assert abs(r.logprob - float(full[row, token])) < 1e-4
        allowed = torch.from_numpy(state.allowed().copy())
        masked = logits[row].masked_fill(~allowed, float("-inf"))
        assert abs(p.logprob - float(torch.log_softmax(masked, -1)[token])) < 1e-4
        state.accept(token)
