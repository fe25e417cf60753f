"""Routed experts' parts that need no served model: a request's route log, the prefix cache
keeping routes beside its blocks, the wire encodings, and expert weights by checkpoint name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenwire.client import decode_routed_experts, decode_sglang_routed_experts
from tokenwire.engine.hf.expert_weights import expert_views
from tokenwire.engine.hf.prefix_cache import BLOCK_TOKENS, PrefixCache, RowKV, block_keys
from tokenwire.engine.hf.routing import RouteLog
from tokenwire.pipeline.routing import routed_experts_int32, routed_experts_npy


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
