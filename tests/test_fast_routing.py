"""Routed experts' parts that need no served model: a request's route log, the prefix cache
keeping routes beside its blocks, the wire encodings, sessions' routing, and expert weights by
checkpoint name."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenwire.client import decode_routed_experts, decode_sglang_routed_experts
from tokenwire.engine.hf.expert_weights import expert_views
from tokenwire.engine.hf.prefix_cache import BLOCK_TOKENS, PrefixCache, RowKV, block_keys
from tokenwire.engine.hf.routing import RouteLog
from tokenwire.pipeline.routing import routed_experts_int32, routed_experts_npy
from tokenwire.pipeline.session_store import NewTurn, Owner, SessionStore
from tokenwire.pipeline.sessions import trajectory


def _rows(start: int, count: int) -> np.ndarray:
    """Distinct rows: position p routes to experts (p % 251, (p + 1) % 251) in both layers."""
    pos = np.arange(start, start + count)
    pair = np.stack([pos % 251, (pos + 1) % 251], axis=-1)
    return np.stack([pair, pair], axis=1).astype(np.uint8)


def test_route_log_sends_each_row_once_and_keeps_rows_a_recompute_saw() -> None:
    log = RouteLog()
    log.add(0, _rows(0, 5))
    assert log.unsent().tolist() == _rows(0, 5).tolist()  # type: ignore[union-attr]
    assert log.unsent() is None
    log.add(5, _rows(5, 1))
    log.add(6, _rows(6, 1))
    assert log.unsent().tolist() == _rows(5, 2).tolist()  # type: ignore[union-attr]
    # A recompute of positions 0..7 routed as before: only position 7 is new.
    log.add(0, _rows(0, 8))
    assert (log.length, log.kv_differs) == (8, False)
    assert log.unsent().tolist() == _rows(7, 1).tolist()  # type: ignore[union-attr]
    # One that routed position 3 otherwise: the log keeps what was sent, and says so.
    changed = _rows(0, 9)
    changed[3] = 0
    log.add(0, changed)
    assert log.kv_differs and log.rows().tolist() == _rows(0, 9).tolist()


def test_prefix_cache_returns_the_routes_kept_with_its_blocks() -> None:
    tokens = list(range(3 * BLOCK_TOKENS + 5))
    layers = [(torch.zeros(1, 2, len(tokens), 4), torch.zeros(1, 2, len(tokens), 4))]
    row = RowKV(layers, 0, torch.arange(len(tokens)))
    cache = PrefixCache(1 << 20)
    first = block_keys(tokens[: 2 * BLOCK_TOKENS])
    cache.keep(first, 2 * BLOCK_TOKENS, lambda: row, _rows(0, 2 * BLOCK_TOKENS))
    keys = block_keys(tokens)
    cache.keep(keys, len(tokens), lambda: row, _rows(0, len(tokens)))
    assert cache.routes(keys).tolist() == _rows(0, 3 * BLOCK_TOKENS).tolist()  # two segments
    assert cache.routes(keys[:1]).tolist() == _rows(0, BLOCK_TOKENS).tolist()
    # Routes of another length than the KV: nothing is kept.
    other = block_keys(list(range(100, 100 + BLOCK_TOKENS)))
    cache.keep(other, BLOCK_TOKENS, lambda: row, _rows(0, 3))
    assert cache.match(other) == 0


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_wire_encodings_decode_back(dtype: type) -> None:
    rows = (np.arange(24).reshape(6, 2, 2) * 9).astype(dtype)
    vllm = decode_routed_experts(routed_experts_npy(rows))  # type: ignore[arg-type]
    assert vllm.dtype == dtype and np.array_equal(vllm, rows)
    sglang = decode_sglang_routed_experts(routed_experts_int32(rows), 2, 2)  # type: ignore[arg-type]
    assert sglang.dtype == np.int32 and np.array_equal(sglang, rows)


def test_sessions_keep_each_turns_new_rows_and_join_a_segments(tmp_path: Path) -> None:
    """A turn extending the head stores the rows from the head's last sampled id on; a new
    segment's first turn all of its own; a segment with a turn recorded without routing (a
    server restarted without capture) has no joined routing."""
    owner = Owner.of(b"k", control=False)
    store = SessionStore(str(tmp_path / "s.sqlite3"), max_bytes=10**6, ttl_s=3600)
    # (new segment's reason or None, prompt ids it adds, sampled ids, routes recorded)
    plan = [(None, 5, 3, True), (None, 4, 2, True), ("rewritten", 9, 2, True), (None, 3, 1, False)]

    async def run() -> dict:
        segment = 0
        for reason, added, sampled, routed in plan:
            head = await store.head("s", owner)
            previous = head.token_ids if head and reason is None else []
            prompt = [*previous, *range(10, 10 + added)]
            segment += reason is not None
            rows = _rows(0, len(prompt) + sampled - 1) if routed else None
            data = {"sampled_ids": [7] * sampled, "logprobs": [0.0] * sampled}
            turn = NewTurn(head, segment, reason, prompt, [7] * sampled, data, [], "", "id", rows)
            assert (await store.record("s", owner, turn)).turn is not None
        return await trajectory(store, "s", owner)

    try:
        result = asyncio.run(run())
    finally:
        store.close()
    turns, segments = result["turns"], result["segments"]
    assert [turn.get("routed_experts_start") for turn in turns] == [0, 7, 0, None]
    for turn in turns[:3]:
        rows = _rows(0, len(turn["prompt_ids"]) + len(turn["sampled_ids"]) - 1)
        start = turn["routed_experts_start"]
        np.testing.assert_array_equal(decode_routed_experts(turn["routed_experts"]), rows[start:])
    ids = segments[0]["token_ids"]
    assert len(ids) == 14
    joined = decode_routed_experts(segments[0]["routed_experts"])
    np.testing.assert_array_equal(joined, _rows(0, len(ids) - 1))
    assert "routed_experts" not in segments[1]


def test_expert_views_are_the_checkpoint_names_of_fused_experts() -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    )
    model = Qwen3MoeForCausalLM(config)
    views = expert_views(model)
    experts = model.model.layers[0].mlp.experts
    gate_up = views["model.layers.0.mlp.experts.gate_up_proj"]
    down = views["model.layers.0.mlp.experts.down_proj"]
    assert len(gate_up) == 8 and len(down) == 4
    with torch.no_grad():
        gate_up["model.layers.0.mlp.experts.2.up_proj.weight"].fill_(7.0)
        down["model.layers.0.mlp.experts.1.down_proj.weight"].fill_(3.0)
    assert bool((experts.gate_up_proj[2, 8:] == 7.0).all())
    assert not bool((experts.gate_up_proj[2, :8] == 7.0).any())
    assert bool((experts.down_proj[1] == 3.0).all())
