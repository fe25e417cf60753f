"""Qwen2-VL's 3D M-RoPE positions, computed per request and passed to the model explicitly.

Why explicit: given ``image_grid_thw`` and no ``position_ids``, transformers' Qwen2-VL computes
positions itself and stores ``rope_deltas`` on the module, shared state that later position-less
calls reuse for whatever request comes next. Each row instead keeps its own rope delta
(``mrope_positions``); decode token ``i`` of a row sits at ``i + delta`` on all three axes, so a
plain [B, 1] position tensor serves a mixed batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenwire.engine.hf.multimodal import RequestMedia


def mrope_positions(
    num_tokens: int,
    placeholders: Sequence[tuple[int, int]],
    grids_thw: Sequence[tuple[int, int, int]],
    merge_size: int,
) -> tuple[torch.Tensor, int]:
    """Qwen2-VL's 3D (t, h, w) rope positions [3, num_tokens] and the rope delta of a prompt.

    Same numbers as ``Qwen2VLModel.get_rope_index`` for one unpadded row, but per request and
    free of model state: text advances all three axes by one per token; an image's tokens get
    its merged grid coordinates offset by the current position, which then moves on by
    ``max(h, w) // merge_size``. Decode token ``i`` (0-based index in the whole sequence,
    ``i >= num_tokens``) has position ``i + delta`` on all three axes.
    """
    parts: list[torch.Tensor] = []
    position = 0
    cursor = 0
    for (offset, length), (t, h, w) in zip(placeholders, grids_thw, strict=True):
        gh, gw = h // merge_size, w // merge_size
        if t * gh * gw != length:
            raise ValueError(f"grid {(t, h, w)} has {t * gh * gw} tokens, range has {length}")
        text = offset - cursor
        parts.append(torch.arange(text).expand(3, -1) + position)
        position += text
        tt, hh, ww = torch.meshgrid(
            torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"
        )
        parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + position)
        position += max(gh, gw)
        cursor = offset + length
    parts.append(torch.arange(num_tokens - cursor).expand(3, -1) + position)
    positions = torch.cat(parts, dim=1).to(torch.int64)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


def prefill_positions(
    prompts: Sequence[Sequence[int]],
    medias: Sequence[RequestMedia | None],
    width: int,
    merge: int,
    device: torch.device,
) -> tuple[torch.Tensor, list[int]]:
    """3D positions [3, n, width] of a left-padded prefill group and each row's rope delta.

    Rows are right-aligned like the ids; padding columns get position 0 (masked anyway).
    A text row's positions are 0..len-1 on every axis and its delta is 0.
    """
    positions = torch.zeros(3, len(prompts), width, dtype=torch.long)
    deltas: list[int] = []
    for row, (prompt, media) in enumerate(zip(prompts, medias, strict=True)):
        n = len(prompt)
        if media is None:
            positions[:, row, width - n :] = torch.arange(n)
            deltas.append(0)
            continue
        pos, delta = mrope_positions(n, media.placeholders, media.grids, merge)
        positions[:, row, width - n :] = pos
        deltas.append(delta)
    return positions.to(device), deltas
