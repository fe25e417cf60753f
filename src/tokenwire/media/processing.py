"""Images -> the tensors a Qwen2-VL-style model consumes, and the prompt placeholders they fill.

The model's chat template writes one ``<|image_pad|>`` per image; the model wants one pad per
merged vision token (``grid_t * grid_h * grid_w // merge_size**2``), so prompts are expanded
here, after the processor has fixed each image's grid. ``/generate`` with ``features`` gets
expanded ids and placeholder ranges from the client; ``validate_placeholder_ranges`` is what
keeps a bad range a 400 instead of a shape error inside the model forward.

Processed items travel in render's ``features.kwargs_data`` as base64 safetensors (never
pickle): ``safetensors`` only ever builds plain tensors from a bounded buffer, and every field
is checked against what this server's processor could have produced.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from PIL import Image

from tokenwire.media.errors import MediaRefused, Rule
from tokenwire.media.hashing import hash_media_bytes, hash_tensors
from tokenwire.media.loaders import MAX_IMAGE_PIXELS, load_image

logger = logging.getLogger("tokenwire.media")

PREPROCESSOR_CONFIG = "preprocessor_config.json"
_QWEN2_VL_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl"})
_MAX_ASPECT_RATIO = 200  # smart_resize's own limit
_KWARGS_KEYS = frozenset({"pixel_values", "image_grid_thw"})
_PIXEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_GRID_DTYPES = (torch.int64, torch.int32)


class ProcessingRule(StrEnum):
    """Refusal rules of this module (``errors.Rule`` holds the connector's and loaders')."""

    INVALID_FEATURES = "invalid multimodal features"
    PLACEHOLDER_MISMATCH = "image placeholders do not match the images"


@dataclass(frozen=True, slots=True, eq=False)
class ProcessedMedia:
    """One processed image: what the model forward needs plus what render reports about it.

    Shared between requests through the cache, so nothing may modify the tensors in place.
    """

    pixel_values: torch.Tensor
    """float32 [grid_t * grid_h * grid_w, channels * temporal_patch_size * patch_size**2]."""
    image_grid_thw: torch.Tensor
    """int64 [1, 3]: the patch grid (t, h, w) before the 2x2 merge."""
    num_placeholder_tokens: int
    """How many ``<|image_pad|>`` ids the image fills in the prompt."""
    content_hash: str
    """The cache key and render's ``mm_hashes`` entry (see ``hashing``)."""
    modality: str = "image"
    nbytes: int = field(init=False)
    """Bytes the tensors hold; what the cache budget counts."""

    def __post_init__(self) -> None:
        size = sum(t.numel() * t.element_size() for t in (self.pixel_values, self.image_grid_thw))
        object.__setattr__(self, "nbytes", size)

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        t, h, w = (int(v) for v in self.image_grid_thw.reshape(-1).tolist())
        return t, h, w


class MediaProcessor:
    """A model's image processor, loaded once at start-up and shared by every request.

    Only the PIL backend is used: transformers' torchvision backend resizes slightly
    differently, and the server's pixels must not depend on which optional package is present.
    """

    def __init__(self, image_processor: Any, *, image_token_id: int | None = None) -> None:
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        """The ``<|image_pad|>`` id from the model's config.json, when it names one."""
        self.patch_size = int(image_processor.patch_size)
        self.merge_size = int(image_processor.merge_size)
        self.temporal_patch_size = int(image_processor.temporal_patch_size)
        self.channels = len(image_processor.image_mean)
        self.patch_dim = self.channels * self.temporal_patch_size * self.patch_size**2
        self.min_pixels = int(image_processor.size["shortest_edge"])
        self.max_pixels = int(image_processor.size["longest_edge"])
        # smart_resize can exceed max_pixels for very thin images (one side is floored at one
        # merged patch); this bounds anything the processor can produce, for kwargs_data checks.
        factor = self.patch_size * self.merge_size
        bound = max(
            self.max_pixels, factor * (math.isqrt(_MAX_ASPECT_RATIO * self.max_pixels) + factor)
        )
        self.max_patches = bound // self.patch_size**2
        self.max_kwargs_chars = 4 * ((self.max_patches * self.patch_dim * 4 + 4096) // 3 + 1)
        self.pixel_range = _pixel_range(image_processor)
        """(lo, hi) any processed pixel lies in; client pixels outside it could overflow the
        vision tower into NaN logits, so ``decode_kwargs_data`` refuses them."""

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> MediaProcessor | None:
        """The processor of a Qwen2-VL-style model dir; None for text-only models.

        A multimodal model of another family also gives None (with a warning): the server
        still serves its text, and media requests get a 400.
        """
        model_dir = Path(model_dir)
        config_path = model_dir / PREPROCESSOR_CONFIG
        if not config_path.is_file():
            return None
        from transformers import AutoImageProcessor  # heavy; only multimodal models pay for it

        processor = AutoImageProcessor.from_pretrained(
            str(model_dir), backend="pil", local_files_only=True
        )
        names = getattr(processor, "model_input_names", ())
        needed = ("patch_size", "merge_size", "temporal_patch_size")
        if "image_grid_thw" not in names or not all(hasattr(processor, a) for a in needed):
            logger.warning(
                "%s: image processor %s is not Qwen2-VL style; media input is disabled",
                model_dir,
                type(processor).__name__,
            )
            return None
        image_token_id = None
        model_config = model_dir / "config.json"
        if model_config.is_file():
            config = json.loads(model_config.read_text())
            if config.get("model_type") not in _QWEN2_VL_MODEL_TYPES:
                logger.warning(
                    "%s: model_type %r is not Qwen2-VL", model_dir, config.get("model_type")
                )
            image_token_id = config.get("image_token_id")
            merge = config.get("vision_config", {}).get("spatial_merge_size")
            if merge is not None and int(merge) != int(processor.merge_size):
                raise ValueError(
                    f"{model_dir}: processor merge_size {processor.merge_size} != "
                    f"vision_config.spatial_merge_size {merge}"
                )
        return cls(processor, image_token_id=image_token_id)

    # -- processing ---------------------------------------------------------------------------

    def process_bytes(self, data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS) -> ProcessedMedia:
        """Decode fetched bytes (``load_image``'s guards) and process; named by the bytes' hash."""
        return self.process_image(load_image(data, max_pixels=max_pixels), hash_media_bytes(data))

    def process_image(self, image: Image.Image, content_hash: str | None = None) -> ProcessedMedia:
        """Resize, normalise and patchify one image exactly as transformers' processor does.

        CPU work of a few ms per image: call it from a worker thread, not the event loop.
        Without ``content_hash`` the item is named by its tensors.
        """
        width, height = image.size
        if max(width, height) > _MAX_ASPECT_RATIO * min(width, height):
            raise MediaRefused(Rule.INVALID_IMAGE, f"aspect ratio of {width}x{height} over 200")
        try:
            out = self.image_processor(images=[image], return_tensors="pt")
        except Exception as exc:  # a processor failure on client media is a 400, never a 500
            raise MediaRefused(Rule.INVALID_IMAGE, f"image processing failed ({exc})") from None
        pixel_values = out["pixel_values"].to(torch.float32).contiguous()
        grid = out["image_grid_thw"].to(torch.int64).reshape(1, 3).contiguous()
        return self._item(pixel_values, grid, content_hash)

    def _item(
        self, pixel_values: torch.Tensor, grid: torch.Tensor, content_hash: str | None
    ) -> ProcessedMedia:
        t, h, w = (int(v) for v in grid[0].tolist())
        if content_hash is None:
            content_hash = hash_tensors(pixel_values=pixel_values, image_grid_thw=grid)
        return ProcessedMedia(
            pixel_values=pixel_values,
            image_grid_thw=grid,
            num_placeholder_tokens=t * h * w // self.merge_size**2,
            content_hash=content_hash,
        )

    # -- features.kwargs_data ------------------------------------------------------------------

    @staticmethod
    def encode_kwargs_data(item: ProcessedMedia) -> str:
        """Base64 of safetensors bytes holding ``pixel_values`` and ``image_grid_thw``."""
        data = safetensors.torch.save(
            {
                "pixel_values": item.pixel_values.contiguous(),
                "image_grid_thw": item.image_grid_thw.contiguous(),
            }
        )
        return base64.b64encode(data).decode("ascii")

    def decode_kwargs_data(self, value: str, *, index: int = 0) -> ProcessedMedia:
        """The item a client sent back; anything this processor could not have made is a 400.

        The item is named by its tensors (``hash_tensors``), never by the client's mm_hash:
        caching client tensors under a client-chosen name would let one client poison another.
        """
        where = f"kwargs_data image {index}"
        if not isinstance(value, str):
            raise MediaRefused(ProcessingRule.INVALID_FEATURES, f"{where} must be a base64 string")
        if len(value) > self.max_kwargs_chars:
            raise MediaRefused(ProcessingRule.INVALID_FEATURES, f"{where} is too large")
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise MediaRefused(ProcessingRule.INVALID_FEATURES, f"{where} is not base64") from None
        try:
            tensors = safetensors.torch.load(raw)
        except Exception:  # SafetensorError, ValueError, ...: all the client's fault
            raise MediaRefused(
                ProcessingRule.INVALID_FEATURES, f"{where} is not a safetensors payload"
            ) from None
        if set(tensors) != _KWARGS_KEYS:
            raise MediaRefused(
                ProcessingRule.INVALID_FEATURES,
                f"{where} must hold exactly pixel_values and image_grid_thw",
            )
        grid = self._checked_grid(tensors["image_grid_thw"], where)
        pixel_values = self._checked_pixels(tensors["pixel_values"], grid, where)
        return self._item(pixel_values, grid, None)

    def _checked_grid(self, grid: torch.Tensor, where: str) -> torch.Tensor:
        if grid.dtype not in _GRID_DTYPES or tuple(grid.shape) != (1, 3):
            raise MediaRefused(
                ProcessingRule.INVALID_FEATURES, f"{where}: image_grid_thw must be int64 [1, 3]"
            )
        t, h, w = (int(v) for v in grid[0].tolist())
        m = self.merge_size
        if t != 1 or h <= 0 or w <= 0 or h % m or w % m or h * w > self.max_patches:
            raise MediaRefused(
                ProcessingRule.INVALID_FEATURES,
                f"{where}: image_grid_thw {[t, h, w]} is not a grid this server's processor makes",
            )
        return grid.to(torch.int64).contiguous()

    def _checked_pixels(self, pixels: torch.Tensor, grid: torch.Tensor, where: str) -> torch.Tensor:
        rows = int(grid.prod())
        if pixels.dtype not in _PIXEL_DTYPES or tuple(pixels.shape) != (rows, self.patch_dim):
            raise MediaRefused(
                ProcessingRule.INVALID_FEATURES,
                f"{where}: pixel_values must be float [{rows}, {self.patch_dim}]",
            )
        pixels = pixels.to(torch.float32).contiguous()
        lo, hi = self.pixel_range
        slack = 0.02 * max(abs(lo), abs(hi), 1.0)  # room for float16 / bfloat16 rounding
        # NaN fails both comparisons, so it is refused here too.
        if not bool(((pixels >= lo - slack) & (pixels <= hi + slack)).all()):
            raise MediaRefused(
                ProcessingRule.INVALID_FEATURES,
                f"{where}: pixel_values outside [{lo:.3f}, {hi:.3f}] or not finite",
            )
        return pixels


def _pixel_range(image_processor: Any) -> tuple[float, float]:
    """The range uint8 pixels map to under the processor's rescale and normalisation."""
    lo, hi = np.zeros(1), np.full(1, 255.0)
    if getattr(image_processor, "do_rescale", False):
        factor = float(image_processor.rescale_factor)
        lo, hi = lo * factor, hi * factor
    if getattr(image_processor, "do_normalize", False):
        mean = np.atleast_1d(np.asarray(image_processor.image_mean, dtype=np.float64))
        std = np.atleast_1d(np.asarray(image_processor.image_std, dtype=np.float64))
        lo, hi = (lo - mean) / std, (hi - mean) / std
    return float(np.min(lo)), float(np.max(hi))


# -- placeholders -------------------------------------------------------------------------------


def expand_image_placeholders(
    token_ids: Sequence[int], image_pad_id: int, counts: Sequence[int]
) -> tuple[list[int], list[tuple[int, int]]]:
    """Expand the i-th ``image_pad_id`` to ``counts[i]`` copies; returns ids and (offset, length).

    The chat template writes one pad per image; any other number of pads means the prompt and
    the images disagree (e.g. a literal ``<|image_pad|>`` in user text), which is a 400.
    """
    pads = [i for i, token in enumerate(token_ids) if token == image_pad_id]
    if len(pads) != len(counts):
        raise MediaRefused(
            ProcessingRule.PLACEHOLDER_MISMATCH,
            f"the prompt has {len(pads)} image placeholders for {len(counts)} images",
        )
    expanded: list[int] = []
    placeholders: list[tuple[int, int]] = []
    start = 0
    for pad, count in zip(pads, counts, strict=True):
        if count < 1:
            raise ValueError(f"an image needs at least one placeholder token, got {count}")
        expanded.extend(token_ids[start:pad])
        placeholders.append((len(expanded), count))
        expanded.extend([image_pad_id] * count)
        start = pad + 1
    expanded.extend(token_ids[start:])
    return expanded, placeholders


def validate_placeholder_ranges(
    token_ids: Sequence[int],
    ranges: Sequence[tuple[int, int]],
    counts: Sequence[int],
    image_pad_id: int,
) -> None:
    """Check client ``mm_placeholders`` against the ids and the items before any forward.

    Ranges must be in prompt order (the model fills pads with image features in order of
    appearance), inside the ids, disjoint, as long as their item's token count, hold only
    ``image_pad_id``, and no pad may sit outside them: the model counts every pad id.
    """
    rule = ProcessingRule.PLACEHOLDER_MISMATCH
    if len(ranges) != len(counts):
        raise MediaRefused(rule, f"{len(ranges)} placeholder ranges for {len(counts)} images")
    n = len(token_ids)
    previous_end = 0
    for i, ((offset, length), count) in enumerate(zip(ranges, counts, strict=True)):
        if offset < 0 or length < 1 or offset + length > n:
            raise MediaRefused(rule, f"image {i}: range ({offset}, {length}) is outside token_ids")
        if offset < previous_end:
            raise MediaRefused(rule, f"image {i}: ranges must be in order and must not overlap")
        if length != count:
            raise MediaRefused(rule, f"image {i}: range length {length} != {count} image tokens")
        if any(token != image_pad_id for token in token_ids[offset : offset + length]):
            raise MediaRefused(rule, f"image {i}: range holds ids other than the image pad id")
        previous_end = offset + length
    total = sum(1 for token in token_ids if token == image_pad_id)
    if total != sum(counts):
        raise MediaRefused(rule, f"{total - sum(counts)} image pad ids lie outside the ranges")
