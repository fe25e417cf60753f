"""Per-request sampling and logprobs for a batch of next-token logits, vLLM semantics.

Order (as in vLLM): raw logprobs are taken from the model's logits first; then repetition /
frequency / presence penalties, min_tokens suppression of stop tokens; greedy rows take the argmax
there; sampled rows go through temperature, min_p, top_k, top_p and one uniform draw.

Why the candidate set: on CPU a full sort of [32, 49152] logits and ``torch.multinomial`` cost
about as much as the forward itself. top_k / top_p / min_p are instead applied to the
``topk(256)`` candidates of each row, which is exact whenever the kept set lies inside them (top_k
<= 256, min_p cuts inside, or the candidates hold the top_p mass); rows not covered try
``topk(2048)``, then a full sort. Pure temperature sampling (+ min_p) needs no sort at all: inverse
CDF in vocabulary order.

Why one uniform per step from a per-request ``torch.Generator``: the draw for a request's n-th
token depends only on its seed, so a seeded request is reproducible whatever else is in the batch.

Structured outputs: a row with a grammar (``SamplingParams.grammar``) has every id its grammar
state does not allow set to -inf after penalties and min_tokens (if those left nothing the
grammar allows, the grammar alone decides), before greedy or temperature; other rows are never
touched, so they and seeded rows sample exactly as without it. The raw logprobs stay the
model's (vLLM's default); "processed_logprobs" and sampling supports see the masked row.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tokenwire.engine.base import (
    GREEDY_TEMPERATURE,
    GrammarState,
    SamplingParams,
    SamplingSupport,
    TokenLogprob,
)
from tokenwire.structured.masks import mask_bias

# Candidate-set sizes tried in turn before a full sort (the first covers nearly every row).
CANDIDATE_TIERS = (256, 2048)


@dataclass(slots=True)
class RowSampler:
    """A request's sampling state: its generator, penalty bookkeeping and output length so far.

    Penalty state is sparse (the ids seen, the output counts) so that applying it touches only
    those ids: small tensor ops stay single-threaded, where [V]-wide ops on a busy 2-core machine
    each paid an OpenMP wake-up.
    """

    params: SamplingParams
    stop_ids: tuple[int, ...]  # ids suppressed until min_tokens (stop_token_ids + eos)
    generator: torch.Generator
    vocab_size: int
    device: torch.device
    seen: set[int] | None = None  # prompt + output ids (repetition penalty)
    counts: dict[int, int] | None = None  # output id counts (frequency/presence)
    num_output: int = 0
    grammar: GrammarState | None = None  # the request's one grammar state (structured outputs)
    _seen_ids: torch.Tensor | None = None
    _count_ids: torch.Tensor | None = None
    _count_vals: torch.Tensor | None = None

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_ids: list[int],
        stop_ids: tuple[int, ...],
        vocab_size: int,
        device: torch.device,
    ) -> RowSampler:
        """Build the state; unseeded requests get a generator seeded from os randomness."""
        gen = torch.Generator(device="cpu")
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        seen = set(prompt_ids) if params.repetition_penalty != 1.0 else None
        penalized = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        stops = tuple(i for i in stop_ids if 0 <= i < vocab_size)
        grammar = params.grammar.new_state() if params.grammar is not None else None
        return cls(
            params, stops, gen, vocab_size, device, seen, {} if penalized else None, 0, grammar
        )

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_TEMPERATURE

    @property
    def suppressing(self) -> bool:
        """min_tokens still holds back the stop ids."""
        return self.num_output < self.params.min_tokens and bool(self.stop_ids)

    @property
    def needs_processing(self) -> bool:
        """Whether logits change before greedy/temperature (penalties or min_tokens)."""
        return (
            self.seen is not None
            or bool(self.counts)
            or (self.num_output < self.params.min_tokens and bool(self.stop_ids))
        )

    def record(self, token_id: int) -> None:
        """Account for a sampled token (penalty state, min_tokens, the grammar's position)."""
        self.num_output += 1
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if self.seen is not None and token_id not in self.seen:
            self.seen.add(token_id)
            self._seen_ids = None
        if self.counts is not None:
            self.counts[token_id] = self.counts.get(token_id, 0) + 1
            self._count_ids = None

    def apply_penalties(self, logits: torch.Tensor) -> None:
        """Penalties (vLLM/HF semantics) and min_tokens suppression on one row, in place."""
        p = self.params
        if self.seen is not None:
            if self._seen_ids is None:
                self._seen_ids = torch.tensor(sorted(self.seen), device=self.device)
            vals = logits[self._seen_ids]
            logits[self._seen_ids] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if self.counts:
            if self._count_ids is None:
                ids = sorted(self.counts)
                self._count_ids = torch.tensor(ids, device=self.device)
                self._count_vals = torch.tensor(
                    [float(self.counts[i]) for i in ids], device=self.device
                )
            assert self._count_vals is not None
            logits[self._count_ids] -= (
                p.frequency_penalty * self._count_vals + p.presence_penalty
            ).to(logits.dtype)
        if self.num_output < p.min_tokens and self.stop_ids:
            logits[list(self.stop_ids)] = float("-inf")


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # Each row's sampling support, for rows that asked (``SamplingParams.sampling_mask``).
    supports: list[SamplingSupport | None] = field(default_factory=list)


def sample(logits: torch.Tensor, rows: list[RowSampler]) -> SampleResult:
    """Pick one token per row of ``logits`` [B, V] (fp32) and compute the requested logprobs."""
    b = logits.shape[0]
    device = logits.device
    processed = logits
    if any(r.needs_processing for r in rows):
        processed = logits.clone()
        for i, r in enumerate(rows):
            if r.needs_processing:
                r.apply_penalties(processed[i])
        processed = finite(processed)
    allowed = _grammar_masks(rows, logits.shape[-1], device)

    tokens = torch.empty(b, dtype=torch.long, device=device)
    # Per-row distribution that "processed_logprobs" reports; filled only where requested.
    final: dict[int, torch.Tensor] = {}
    wants_processed = [
        r.params.logprobs is not None and r.params.logprobs_mode == "processed_logprobs"
        for r in rows
    ]
    # Sampling supports: filled only for the rows that asked (none: no extra work).
    supports: dict[int, SamplingSupport] = {}

    greedy = [i for i, r in enumerate(rows) if r.greedy]
    if greedy:
        gi = torch.tensor(greedy, device=device)
        tokens[gi] = processed[gi].argmax(dim=-1)
        for i in greedy:
            row = processed[i]
            if i in allowed:
                fallback = (lambda i=i: finite(logits[i])) if rows[i].suppressing else None
                row = _constrain(row, allowed[i], fallback)
                tokens[i] = row.argmax()
            if wants_processed[i]:
                final[i] = row

    sampled = [i for i, r in enumerate(rows) if not r.greedy]
    if sampled:
        _sample_rows(
            processed, rows, sampled, tokens, final, wants_processed, supports, allowed, logits
        )

    token_list = tokens.tolist()
    result = SampleResult(token_ids=token_list, logprobs=[None] * b, supports=[None] * b)
    for i in greedy:
        if rows[i].params.sampling_mask:  # greedy draws from its argmax alone
            supports[i] = SamplingSupport((token_list[i],), 0.0)
    for i, support in supports.items():
        result.supports[i] = support
    lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if lp_rows:
        sources = [final[i] if wants_processed[i] else logits[i] for i in lp_rows]
        params = [rows[i].params for i in lp_rows]
        given = [p.logprob_token_ids for p in params]
        ks = [0 if p.logprob_token_ids is not None else p.logprobs or 0 for p in params]
        chosen = [token_list[i] for i in lp_rows]
        entries = token_logprobs(torch.stack(sources), chosen, ks, given)
        for i, tl in zip(lp_rows, entries, strict=True):
            result.logprobs[i] = tl
    return result


@dataclass(slots=True)
class _Scaled:
    """The non-greedy rows of one step after temperature, with their draws."""

    logits: torch.Tensor  # [S, V] processed logits / temperature
    u: torch.Tensor  # [S] float64 uniform draws
    log_min_p: torch.Tensor  # [S] log(min_p), -inf when off
    params: list[SamplingParams]
    batch_rows: list[int]  # S -> row in the batch
    tokens: torch.Tensor  # [B] output, written in place
    final: dict[int, torch.Tensor]  # batch row -> filtered logits, for processed logprobs
    wants_processed: list[bool]  # per batch row
    supports: dict[int, SamplingSupport]  # batch row -> its support, for rows that asked

    def emit(self, sel: list[int], chosen: torch.Tensor) -> None:
        rows = torch.tensor([self.batch_rows[j] for j in sel], device=self.tokens.device)
        self.tokens[rows] = chosen

    def support(self, j: int, ids: torch.Tensor, probs: torch.Tensor, token: int) -> None:
        """Keep row j's support: ``ids`` left to draw from, ``probs`` their (unnormalised)
        probabilities in the same order, ``token`` the drawn one."""
        order = torch.argsort(ids)
        ids, probs = ids[order], probs[order].double()
        sampled = probs[ids == token].sum()
        logprob = math.log(float(sampled / probs.sum())) if sampled > 0 else -math.inf
        self.supports[self.batch_rows[j]] = SamplingSupport(tuple(ids.tolist()), logprob)


def _sample_rows(
    processed: torch.Tensor,
    rows: list[RowSampler],
    idx: list[int],
    tokens: torch.Tensor,
    final: dict[int, torch.Tensor],
    wants_processed: list[bool],
    supports: dict[int, SamplingSupport],
    allowed: dict[int, torch.Tensor],
    raw: torch.Tensor,
) -> None:
    """Temperature, the grammar masks (``allowed``, by batch row), min_p, top_k, top_p and the
    draw for the non-greedy rows ``idx``."""
    device = processed.device
    vocab = processed.shape[-1]
    params = [rows[i].params for i in idx]
    temp = torch.tensor([p.temperature for p in params], device=device)
    draws = [torch.rand(1, generator=rows[i].generator, dtype=torch.float64).item() for i in idx]
    scaled = finite(processed[torch.tensor(idx, device=device)] / temp.unsqueeze(1))
    # A row left with no finite logit (only a model producing NaN could do that) samples from
    # its raw logits instead of failing.
    dead = (~torch.isfinite(scaled).any(dim=-1)).nonzero().flatten().tolist()
    for r in dead:
        scaled[r] = finite(processed[idx[r]].nan_to_num(nan=0.0))
    for j, i in enumerate(idx):
        if i in allowed:
            fallback = (lambda i=i, j=j: finite(raw[i] / temp[j])) if rows[i].suppressing else None
            scaled[j] = _constrain(scaled[j], allowed[i], fallback)
    ctx = _Scaled(
        logits=scaled,
        u=torch.tensor(draws, dtype=torch.float64, device=device),
        log_min_p=torch.tensor(
            [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=device
        ),
        params=params,
        batch_rows=idx,
        tokens=tokens,
        final=final,
        wants_processed=wants_processed,
        supports=supports,
    )
    unfiltered = [_top_k(p, vocab) == 0 and p.top_p >= 1.0 for p in params]
    full = [j for j, f in enumerate(unfiltered) if f]
    if full:
        _sample_vocab_order(ctx, full)
    pending = [j for j, f in enumerate(unfiltered) if not f]
    for tier in CANDIDATE_TIERS:
        if not pending:
            break
        pending = _sample_candidates(ctx, pending, min(tier, vocab))
    if pending:
        _sample_candidates(ctx, pending, vocab)


# A grammar step allowing at most this many ids is applied by copying them into a row of -inf
# (JSON's structural positions allow a handful); more, by adding a 0 / -inf bias.
SPARSE_MASK_IDS = 4096


def _grammar_masks(rows: list[RowSampler], vocab: int, device: torch.device) -> dict[int, Any]:
    """Each constrained row's next-token mask: its allowed ids (int64, few) or an additive
    bias over the vocabulary (float32, 0 allowed, -inf not). Unconstrained rows: none."""
    masks: dict[int, Any] = {}
    dense: list[int] = []
    dense_words: list[np.ndarray] = []
    for i, r in enumerate(rows):
        if r.grammar is None:
            continue
        words = r.grammar.bitmask()
        if int(np.bitwise_count(words.view(np.uint32)).sum()) <= SPARSE_MASK_IDS:
            bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab]
            masks[i] = torch.from_numpy(np.flatnonzero(bits)).to(device)
        else:
            dense.append(i)
            dense_words.append(words)
    if dense:
        biases = mask_bias(np.stack(dense_words), vocab).to(device)
        masks.update(zip(dense, biases, strict=True))
    return masks


def _constrain(
    row: torch.Tensor, bias: torch.Tensor, fallback: Callable[[], torch.Tensor] | None
) -> torch.Tensor:
    """``row`` under its grammar's mask (``_grammar_masks``: -inf on the ids it does not
    allow). ``fallback`` (given only while min_tokens suppresses stop ids) makes the row
    without the suppression, masked instead when the mask left nothing: the grammar wins."""
    out = _masked(row, bias)
    if fallback is not None and not bool(torch.isfinite(out).any()):
        out = _masked(fallback(), bias)
    return out


def _masked(row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``row`` under a grammar mask: only the allowed ids (int64) kept, or the bias added."""
    if mask.dtype == torch.int64:
        out = torch.full_like(row, float("-inf"))
        out[mask] = row[mask]
        return out
    return row + mask


def finite(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf (never picked) and +inf -> the largest float: every later step stays defined.

    Request values are bounded so that this never changes anything; it is the guard that keeps
    a value that slipped through from failing the whole batch.
    """
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)


def _top_k(p: SamplingParams, vocab: int) -> int:
    """top_k with every "off" spelling (0, -1, >= vocab) mapped to 0."""
    return p.top_k if 0 < p.top_k < vocab else 0


def _sample_vocab_order(ctx: _Scaled, sel: list[int]) -> None:
    """Rows with neither top_k nor top_p: inverse CDF in vocabulary order (no sort, no topk)."""
    device = ctx.logits.device
    js = torch.tensor(sel, device=device)
    logits = ctx.logits[js]
    if bool(torch.isfinite(ctx.log_min_p[js]).any()):
        threshold = logits.amax(dim=-1, keepdim=True) + ctx.log_min_p[js].unsqueeze(1)
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    cum = probs.cumsum(dim=-1, dtype=torch.float64)
    target = (ctx.u[js] * cum[:, -1]).unsqueeze(1)
    pick = torch.searchsorted(cum, target, right=True).clamp_(max=probs.shape[-1] - 1)
    landed = probs.gather(1, pick).squeeze(1)
    pick = pick.squeeze(1)
    for r in (landed == 0).nonzero().flatten().tolist():  # rounding past the last kept token
        pick[r] = probs[r].nonzero()[-1, 0]
    ctx.emit(sel, pick)
    for r, j in enumerate(sel):
        if ctx.wants_processed[ctx.batch_rows[j]]:
            ctx.final[ctx.batch_rows[j]] = logits[r]
        if ctx.params[j].sampling_mask:
            kept = torch.isfinite(logits[r]).nonzero().squeeze(1)
            ctx.support(j, kept, probs[r][kept], int(pick[r]))


def _sample_candidates(ctx: _Scaled, sel: list[int], kk: int) -> list[int]:
    """Rows with top_k or top_p, filtered on their ``topk(kk)``; returns the rows not covered.

    A row is covered when its kept set provably lies inside the candidates: top_k <= kk, min_p
    cuts inside them, they hold the top_p mass, or kk is the whole vocabulary.
    """
    device = ctx.logits.device
    vocab = ctx.logits.shape[-1]
    js = torch.tensor(sel, device=device)
    logits = ctx.logits[js]
    params = [ctx.params[j] for j in sel]
    top_k = [_top_k(p, vocab) for p in params]
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device)
    k_lim = torch.tensor([k if 0 < k <= kk else kk for k in top_k], device=device).unsqueeze(1)

    cand_vals, cand_ids = torch.topk(logits, kk, dim=-1)
    threshold = cand_vals[:, :1] + ctx.log_min_p[js].unsqueeze(1)  # min_p: p >= min_p * p_max
    keep = (cand_vals >= threshold) & (torch.arange(kk, device=device).unsqueeze(0) < k_lim)
    # Without top_k, a row whose min_p survivors reach past the candidates needs the full Z.
    topk_active = torch.tensor([0 < k <= kk for k in top_k], device=device)
    open_tail = ~topk_active & keep[:, -1]
    masked = cand_vals.masked_fill(~keep, float("-inf"))
    log_z = torch.logsumexp(masked, dim=-1)
    if kk < vocab and bool(open_tail.any()):
        full_z = torch.logsumexp(logits.masked_fill(logits < threshold, float("-inf")), dim=-1)
        log_z = torch.where(open_tail, full_z, log_z)
    probs = torch.exp((masked - log_z.unsqueeze(1)).double())
    cum = probs.cumsum(dim=-1)
    # vLLM: drop the tail whose mass is <= 1 - top_p; top_p 1 drops nothing (not even the
    # candidates whose probability rounds to 0, which are part of the support it reports).
    keep &= ((cum - probs) < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)
    if kk >= vocab:
        covered = [True] * len(sel)
    else:
        fits = torch.tensor([k <= kk for k in top_k], device=device)
        covered = ((~open_tail | (cum[:, -1] >= top_p)) & fits).tolist()

    kept_cum = (probs * keep).cumsum(dim=-1)
    target = (ctx.u[js] * kept_cum[:, -1]).unsqueeze(1)
    pick = torch.searchsorted(kept_cum, target, right=True).squeeze(1)
    pick = torch.minimum(pick, keep.sum(dim=-1) - 1)  # the kept set is a prefix
    chosen = cand_ids.gather(1, pick.unsqueeze(1)).squeeze(1)
    done = [r for r, ok in enumerate(covered) if ok]
    if done:
        ctx.emit([sel[r] for r in done], chosen[torch.tensor(done, device=device)])
    for r in done:
        i = ctx.batch_rows[sel[r]]
        if ctx.wants_processed[i]:
            row = torch.full_like(logits[r], float("-inf"))
            row[cand_ids[r][keep[r]]] = cand_vals[r][keep[r]]
            ctx.final[i] = row
        if params[r].sampling_mask:
            kept = keep[r] & torch.isfinite(cand_vals[r])
            ctx.support(sel[r], cand_ids[r][kept], probs[r][kept], int(chosen[r]))
    return [sel[r] for r, ok in enumerate(covered) if not ok]


def token_logprobs(
    logits: torch.Tensor,
    chosen: list[int],
    ks: list[int],
    given: list[tuple[int, ...] | None] | None = None,
) -> list[TokenLogprob]:
    """Logprob, rank and top-k of ``chosen`` for each row of ``logits`` [R, V] (log_softmax, fp32).

    rank = 1 + the number of tokens with a strictly higher logprob. A row with ``given`` ids
    (vLLM's ``logprob_token_ids``) lists those ids' logprobs, in their order, as its top.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(chosen, device=lp.device).unsqueeze(1)
    chosen_lp = lp.gather(1, ids)
    ranks = ((lp > chosen_lp).sum(dim=-1) + 1).tolist()
    chosen_l = chosen_lp.squeeze(1).tolist()
    kmax = min(max(ks), lp.shape[-1]) if ks else 0
    top_v: list[list[float]] = [[] for _ in chosen]
    top_i: list[list[int]] = [[] for _ in chosen]
    if kmax > 0:
        tv, ti = torch.topk(lp, kmax, dim=-1)
        top_v, top_i = tv.tolist(), ti.tolist()
    widths = list(ks)
    for j, row_ids in enumerate(given or ()):
        if row_ids is not None:
            top_i[j] = list(row_ids)
            top_v[j] = lp[j, list(row_ids)].tolist()
            widths[j] = len(row_ids)
    return [
        TokenLogprob(
            token_id=tok,
            logprob=lp_val,
            rank=rank,
            top=tuple(zip(top_i[j][:k], top_v[j][:k], strict=True)),
        )
        for j, (tok, lp_val, rank, k) in enumerate(
            zip(chosen, chosen_l, ranks, widths, strict=True)
        )
    ]
