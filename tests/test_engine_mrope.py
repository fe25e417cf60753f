"""M-RoPE positions: the engine's per-request numbers equal transformers' ``get_rope_index``."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tokenwire.engine.hf.mrope import mrope_positions
from tokenwire.media.processing import expand_image_placeholders

PAD = 151655  # <|image_pad|>


def test_mrope_positions_match_transformers_get_rope_index() -> None:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    ids, ranges = expand_image_placeholders([7, 8, PAD, 9, PAD, 10, 11], PAD, [6, 8])
    grids = [(1, 4, 6), (1, 8, 4)]
    positions, delta = mrope_positions(len(ids), ranges, grids, 2)
    # get_rope_index reads only the merge size and a stateless helper from ``self``.
    fake_self = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2)),
        get_vision_position_ids=lambda *a, **k: Qwen2VLModel.get_vision_position_ids(None, *a, **k),
    )
    input_ids = torch.tensor([ids])
    expected, expected_delta = Qwen2VLModel.get_rope_index(
        fake_self, input_ids, (input_ids == PAD).long(), image_grid_thw=torch.tensor(grids)
    )
    assert torch.equal(positions, expected[:, 0]) and delta == int(expected_delta)
    assert positions[:, :2].tolist() == [[0, 1]] * 3
    assert positions[:, 2:8].tolist() == [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]]
    text_only, zero = mrope_positions(3, [], [], 2)
    assert text_only.tolist() == [[0, 1, 2]] * 3 and zero == 0
