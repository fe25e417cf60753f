"""The hf sampler's grammar masks, without a model or a grammar engine: a constrained row
samples only what its grammar state allows, the other rows of the batch sample exactly what they
sample without it, and the logprobs a constrained token reports follow ``logprobs_mode``."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from tokenwire.engine.base import SamplingParams
from tokenwire.engine.hf.sampling import RowSampler, sample

pytestmark = pytest.mark.hf_only  # the hf engine's sampler

VOCAB = 3000
ALLOWED = (5, 17, 400, 2999)


class FixedState:
    """A grammar state that always allows ``ALLOWED`` and records what it was fed."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def bitmask(self) -> np.ndarray:
        mask = np.zeros(-(-VOCAB // 32) * 32, dtype=np.bool_)
        mask[list(ALLOWED)] = True
        return np.packbits(mask, bitorder="little").view(np.int32)

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)


class FixedGrammar:
    def __init__(self) -> None:
        self.states: list[FixedState] = []

    def new_state(self) -> FixedState:
        state = FixedState()
        self.states.append(state)
        return state


MIX = [
    SamplingParams(max_tokens=1, temperature=1.0),
    SamplingParams(max_tokens=1, temperature=0.7, top_k=40),
    SamplingParams(max_tokens=1, temperature=0.0),
    SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, min_p=0.01),
    SamplingParams(max_tokens=1, temperature=1.3, repetition_penalty=1.2, min_tokens=2),
]


def _rows(params: list[SamplingParams], stop_ids: tuple[int, ...] = ()) -> list[RowSampler]:
    return [
        RowSampler.create(
            dataclasses.replace(sp, seed=j), [1, 5], stop_ids, VOCAB, torch.device("cpu")
        )
        for j, sp in enumerate(params)
    ]


@pytest.mark.parametrize("trial", range(4))
def test_constrained_rows_keep_to_the_mask_and_others_are_untouched(trial: int) -> None:
    gen = torch.Generator().manual_seed(trial)
    logits = torch.randn(len(MIX), VOCAB, generator=gen) * 3.0
    free = sample(logits, _rows(MIX))
    for constrained in range(len(MIX)):
        grammar = FixedGrammar()
        params = list(MIX)
        params[constrained] = dataclasses.replace(params[constrained], grammar=grammar)
        rows = _rows(params)
        got = sample(logits, rows)
        assert got.token_ids[constrained] in ALLOWED
        others = [i for i in range(len(MIX)) if i != constrained]
        assert [got.token_ids[i] for i in others] == [free.token_ids[i] for i in others]
        rows[constrained].record(got.token_ids[constrained])
        assert grammar.states[0].accepted == [got.token_ids[constrained]]


def test_greedy_constrained_takes_the_best_allowed_id() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[0, 17] = 5.0
    logits[0, 400] = 6.0
    logits[0, 1000] = 50.0  # the free argmax, not allowed
    sp = SamplingParams(max_tokens=1, temperature=0.0, grammar=FixedGrammar())
    assert sample(logits, _rows([sp])).token_ids == [400]


def test_min_tokens_never_leaves_a_constrained_row_without_a_token() -> None:
    """The grammar allows only a stop id while min_tokens suppresses it: the grammar wins."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(max_tokens=4, min_tokens=3, temperature=t, grammar=FixedGrammar())
        for t in (0.0, 1.0)
    ]
    rows = _rows(params, stop_ids=ALLOWED)
    assert all(t in ALLOWED for t in sample(logits, rows).token_ids)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.5])
def test_constrained_logprobs_raw_or_processed(temperature: float) -> None:
    """raw_logprobs: the model's log-softmax (as a trainer recomputes it); processed_logprobs:
    the masked distribution sampled from, renormalised over the allowed ids."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5)) * 2.0
    base = SamplingParams(max_tokens=1, temperature=temperature, logprobs=2, seed=1)
    raw = sample(logits, _rows([dataclasses.replace(base, grammar=FixedGrammar())]))
    token = raw.token_ids[0]
    assert token in ALLOWED
    entry = raw.logprobs[0]
    assert entry is not None
    assert abs(entry.logprob - float(torch.log_softmax(logits[0], -1)[token])) < 1e-5
    processed_params = dataclasses.replace(
        base, grammar=FixedGrammar(), logprobs_mode="processed_logprobs"
    )
    processed = sample(logits, _rows([processed_params]))
    assert processed.token_ids == [token]
    entry = processed.logprobs[0]
    assert entry is not None
    scaled = logits[0, list(ALLOWED)] / (temperature or 1.0)
    expected = float(torch.log_softmax(scaled, -1)[ALLOWED.index(token)])
    assert abs(entry.logprob - expected) < 1e-5
    assert {i for i, _ in entry.top} <= set(ALLOWED)
    assert sum(math.exp(v) for _, v in entry.top) <= 1.0 + 1e-5


def test_sampling_supports_are_inside_the_mask() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(6))
    params = [
        SamplingParams(max_tokens=1, temperature=1.0, top_k=50, sampling_mask=True),
        SamplingParams(max_tokens=1, temperature=0.0, sampling_mask=True),
    ]
    params = [dataclasses.replace(p, grammar=FixedGrammar()) for p in params]
    got = sample(logits, _rows(params))
    sampled = got.supports[0]
    assert sampled is not None and set(sampled.token_ids) == set(ALLOWED)
    greedy = got.supports[1]
    assert greedy is not None and greedy.token_ids == (got.token_ids[1],)


class DenseState(FixedState):
    """Allows every id but the first 2000: past the sparse path, so a bias is added."""

    def bitmask(self) -> np.ndarray:
        mask = np.ones(-(-VOCAB // 32) * 32, dtype=np.bool_)
        mask[:2000] = False
        return np.packbits(mask, bitorder="little").view(np.int32)


class DenseGrammar(FixedGrammar):
    def new_state(self) -> DenseState:
        return DenseState()


def test_dense_masks_add_a_bias(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tokenwire.engine.hf.sampling.SPARSE_MASK_IDS", 100)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(8)) * 3.0
    logits[:, 7] = 40.0  # the free favourite, not allowed
    params = [
        SamplingParams(max_tokens=1, temperature=t, logprobs=0, grammar=DenseGrammar(), **kw)
        for t, kw in ((0.0, {}), (1.0, {}), (0.8, {"top_k": 20}))
    ]
    params = [dataclasses.replace(p, logprobs_mode="processed_logprobs") for p in params]
    got = sample(logits, _rows(params))
    assert all(t >= 2000 for t in got.token_ids)
    for j, (token, entry) in enumerate(zip(got.token_ids, got.logprobs, strict=True)):
        assert entry is not None and math.isfinite(entry.logprob)
        if j == 0:
            assert token == int(logits[0, 2000:].argmax()) + 2000
