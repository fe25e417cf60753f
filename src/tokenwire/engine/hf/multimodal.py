"""Qwen2-VL-style image input for the ``hf`` engine: checks and prefill tensors.

Positions for these prompts are M-RoPE's, computed per request in ``mrope``.

Everything in ``check_media`` runs before a request is queued: a bad range or grid must be an
``EngineError`` (a 400), never a shape error inside the model forward that fails its group.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenwire.engine.base import EngineError, ImageInput, MultiModalInput

QWEN2_VL_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl"})
QWEN2_VL_ARCHITECTURES = frozenset(
    {"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"}
)


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """What the engine must know about a Qwen2-VL-style model to check and feed images."""

    image_token_id: int
    merge_size: int
    patch_dim: int

    @classmethod
    def from_config(cls, config: Any) -> VisionSpec | None:
        """The spec of a Qwen2-VL-family config; None for every other model (text path)."""
        model_type = getattr(config, "model_type", None)
        architectures = set(getattr(config, "architectures", None) or ())
        if model_type not in QWEN2_VL_MODEL_TYPES and not architectures & QWEN2_VL_ARCHITECTURES:
            return None
        vision = config.vision_config
        image_token_id = getattr(config, "image_token_id", None)
        if image_token_id is None:
            image_token_id = getattr(config, "image_token_index", None)
        if image_token_id is None:
            raise ValueError("the Qwen2-VL config names no image_token_id")
        channels = int(getattr(vision, "in_channels", None) or getattr(vision, "in_chans", 3))
        patch = int(vision.patch_size)
        return cls(
            image_token_id=int(image_token_id),
            merge_size=int(vision.spatial_merge_size),
            patch_dim=channels * int(vision.temporal_patch_size) * patch * patch,
        )


@dataclass(frozen=True, slots=True)
class RequestMedia:
    """A request's checked images in prompt order: placeholder ranges, grids and pixels."""

    placeholders: tuple[tuple[int, int], ...]
    grids: tuple[tuple[int, int, int], ...]
    pixel_values: tuple[torch.Tensor, ...]  # [t*h*w, patch_dim] each, shared: never modified


def check_media(media: Any, prompt: Sequence[int], spec: VisionSpec) -> RequestMedia | None:
    """Check ``media`` against the (already expanded) prompt; None when it holds no image.

    Raises ``EngineError`` for anything the forward could not take, so bad media never reaches
    the engine thread.
    """
    if not isinstance(media, MultiModalInput) or not isinstance(media.images, tuple | list):
        raise EngineError("media must be a MultiModalInput holding a tuple of ImageInput")
    pad = spec.image_token_id
    n = len(prompt)
    placeholders: list[tuple[int, int]] = []
    grids: list[tuple[int, int, int]] = []
    pixels: list[torch.Tensor] = []
    previous_end = 0
    for i, image in enumerate(media.images):
        where = f"image {i}"
        if not isinstance(image, ImageInput):
            raise EngineError(f"{where}: must be an ImageInput")
        try:
            offset, length = operator.index(image.offset), operator.index(image.length)
        except TypeError:
            raise EngineError(f"{where}: offset and length must be ints") from None
        if offset < 0 or length < 1 or offset + length > n:
            raise EngineError(
                f"{where}: placeholder range [{offset}, {offset + length}) is outside the "
                f"prompt of {n} tokens"
            )
        if offset < previous_end:
            raise EngineError(f"{where}: placeholder ranges must be in prompt order, not overlap")
        if any(t != pad for t in prompt[offset : offset + length]):
            raise EngineError(
                f"{where}: placeholder range [{offset}, {offset + length}) holds tokens other "
                f"than the image token {pad}"
            )
        grid = _check_grid(image.image_grid_thw, where, spec.merge_size)
        t, h, w = grid
        if t * h * w // spec.merge_size**2 != length:
            raise EngineError(
                f"{where}: image_grid_thw {list(grid)} makes "
                f"{t * h * w // spec.merge_size**2} image tokens, the range has {length}"
            )
        pixels.append(_check_pixels(image.pixel_values, t * h * w, spec.patch_dim, where))
        placeholders.append((offset, length))
        grids.append(grid)
        previous_end = offset + length
    total = sum(1 for t in prompt if t == pad)
    expected = sum(length for _, length in placeholders)
    if total != expected:
        raise EngineError(
            f"the prompt holds {total} image tokens but the images fill {expected}: every "
            "image token must lie in exactly one image's range"
        )
    if not placeholders:
        return None
    return RequestMedia(tuple(placeholders), tuple(grids), tuple(pixels))


def _check_grid(grid: Any, where: str, merge: int) -> tuple[int, int, int]:
    if not isinstance(grid, torch.Tensor) or grid.numel() != 3 or grid.dtype.is_floating_point:
        raise EngineError(f"{where}: image_grid_thw must be an integer tensor [1, 3]")
    t, h, w = (int(v) for v in grid.reshape(-1).tolist())
    if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
        raise EngineError(
            f"{where}: image_grid_thw {[t, h, w]} must be positive with h and w multiples of "
            f"the merge size {merge}"
        )
    return t, h, w


def _check_pixels(pixels: Any, rows: int, patch_dim: int, where: str) -> torch.Tensor:
    if not isinstance(pixels, torch.Tensor) or not pixels.dtype.is_floating_point:
        raise EngineError(f"{where}: pixel_values must be a float tensor")
    if tuple(pixels.shape) != (rows, patch_dim):
        raise EngineError(
            f"{where}: pixel_values has shape {list(pixels.shape)}; its grid needs "
            f"[{rows}, {patch_dim}] (t*h*w patches of {patch_dim} values)"
        )
    # NaN/inf pixels would turn the whole row's logits into NaN and fail sampling mid-batch.
    if not bool(torch.isfinite(pixels).all()):
        raise EngineError(f"{where}: pixel_values must be finite")
    return pixels


def prefill_media_kwargs(
    medias: Sequence[RequestMedia | None], device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``pixel_values`` and ``image_grid_thw`` of a prefill group, in row-major prompt order.

    The model fills image tokens with vision features in the order they appear in the
    flattened ids, so images are concatenated row by row, each row's in prompt order.
    """
    pixels: list[torch.Tensor] = []
    grids: list[tuple[int, int, int]] = []
    for media in medias:
        if media is not None:
            pixels.extend(media.pixel_values)
            grids.extend(media.grids)
    if not pixels:
        return {}
    return {
        "pixel_values": torch.cat([p.to(device=device, dtype=dtype) for p in pixels]),
        "image_grid_thw": torch.tensor(grids, dtype=torch.long, device=device),
    }
