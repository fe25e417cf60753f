"""Media processing for Qwen2-VL-style models: cache, processor parity, placeholders, features."""

from __future__ import annotations

import base64
import hashlib
import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from PIL import Image

from tokenwire.assets import prepare
from tokenwire.media.cache import MediaCache
from tokenwire.media.errors import MediaRefused
from tokenwire.media.hashing import hash_media_bytes, hash_tensors
from tokenwire.media.processing import (
    MediaProcessor,
    ProcessedMedia,
    expand_image_placeholders,
    validate_placeholder_ranges,
)

PAD = 151655  # <|image_pad|>


def fake_item(name: str, rows: int) -> ProcessedMedia:
    """A cheap item whose size is 16 * rows + 24 bytes (float32 [rows, 4] + int64 [1, 3])."""
    return ProcessedMedia(
        pixel_values=torch.zeros(rows, 4),
        image_grid_thw=torch.tensor([[1, 2, 2]]),
        num_placeholder_tokens=1,
        content_hash=name,
    )


def png(array: np.ndarray, mode: str | None = None) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array, mode).save(buffer, "PNG")
    return buffer.getvalue()


def noise(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (height, width, channels), dtype=np.uint8)


# -- cache ------------------------------------------------------------------------------------


def test_cache_evicts_least_recently_used_by_bytes() -> None:
    a, b, c = fake_item("a", 10), fake_item("b", 10), fake_item("c", 10)
    assert a.nbytes == 16 * 10 + 24
    cache = MediaCache(max_bytes=2 * a.nbytes)
    assert cache.put(a) and cache.put(b)
    assert cache.get("a") is a  # a is now the most recently used
    assert cache.put(c)
    assert "b" not in cache and "a" in cache and "c" in cache
    stats = cache.stats()
    assert (stats.items, stats.bytes, stats.evictions) == (2, 2 * a.nbytes, 1)
    big = fake_item("big", 20)  # needs both slots
    assert cache.put(big)
    assert len(cache) == 1 and cache.stats().bytes == big.nbytes


def test_cache_refuses_items_that_never_fit_and_counts_bytes_once() -> None:
    item = fake_item("x", 10)
    assert not MediaCache(max_bytes=item.nbytes - 1).put(item)
    assert not MediaCache(max_bytes=0).put(item)  # 0 disables caching
    cache = MediaCache(max_bytes=10 * item.nbytes)
    cache.put(item)
    cache.put(fake_item("x", 10))  # same content hash: kept once
    assert cache.stats().bytes == item.nbytes and cache.get("x") is item
    with pytest.raises(ValueError):
        MediaCache(max_bytes=-1)


def test_cache_uuid_aliases_the_content_hash() -> None:
    cache = MediaCache(max_bytes=10_000)
    first, second = fake_item("h1", 1), fake_item("h2", 1)
    cache.put(first, uuid="u")
    assert cache.get_by_uuid("u") is first and cache.get("h1") is first
    assert cache.stats().items == 1  # one entry, two names
    cache.put(second, uuid="u")  # the uuid now names the second item
    assert cache.get_by_uuid("u") is second and cache.get("h1") is first
    # A uuid lives in its own namespace: it never shadows a content hash and vice versa.
    cache.put(fake_item("h3", 1), uuid="h1")
    assert cache.get("h1") is first and cache.get_by_uuid("h1").content_hash == "h3"
    assert cache.get_by_uuid("h2") is None


def test_cache_eviction_drops_uuid_aliases_and_stats_count() -> None:
    item = fake_item("a", 10)
    cache = MediaCache(max_bytes=item.nbytes)
    cache.put(item, uuid="u")
    cache.put(fake_item("b", 10))  # evicts a and its alias
    assert cache.get_by_uuid("u") is None and cache.get("a") is None
    assert cache.get("b") is not None
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.items, stats.evictions) == (1, 2, 1, 1)
    cache.clear()
    assert cache.stats().items == 0 and cache.stats().bytes == 0


# -- processor ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return prepare("qwen2-vl-tiny")


@pytest.fixture(scope="module")
def processor(model_dir: Path) -> MediaProcessor:
    loaded = MediaProcessor.from_model_dir(model_dir)
    assert loaded is not None
    return loaded


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    """transformers' own Qwen2-VL image processor (PIL backend, as the server uses)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))


def test_text_only_model_dir_has_no_processor(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    assert MediaProcessor.from_model_dir(tmp_path) is None


def test_processor_reads_the_model_config(processor: MediaProcessor) -> None:
    assert processor.image_token_id == PAD
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (14, 2, 2)
    assert processor.patch_dim == 3 * 2 * 14 * 14


@pytest.mark.parametrize(
    ("array", "mode"),
    [(noise(70, 90), None), (noise(300, 200, seed=1), None), (noise(40, 50, 4, seed=2), "RGBA")],
)
def test_process_png_matches_transformers(
    processor: MediaProcessor, reference: Any, array: np.ndarray, mode: str | None
) -> None:
    data = png(array, mode)
    item = processor.process_bytes(data)
    expected = reference(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
    if mode is None:  # RGBA is flattened on white by load_image, so only the grid compares
        assert torch.allclose(item.pixel_values, expected["pixel_values"].float(), atol=1e-6)
    assert torch.equal(item.image_grid_thw, expected["image_grid_thw"].long())
    t, h, w = item.grid_thw
    assert item.num_placeholder_tokens == t * h * w // 4
    assert item.pixel_values.shape == (t * h * w, processor.patch_dim)
    height, width = array.shape[:2]
    assert h * w == reference.get_number_of_image_patches(height, width)
    assert item.content_hash == hash_media_bytes(data) == hashlib.sha256(data).hexdigest()
    assert item.nbytes == item.pixel_values.numel() * 4 + 3 * 8


def test_process_refuses_bad_images(processor: MediaProcessor) -> None:
    with pytest.raises(MediaRefused) as excinfo:
        processor.process_bytes(png(noise(1, 300)))  # aspect ratio 300 > 200
    assert excinfo.value.status == 400
    with pytest.raises(MediaRefused):
        processor.process_bytes(b"\x89PNG\r\n\x1a\n not really")


# -- features.kwargs_data ---------------------------------------------------------------------


def encode(**tensors: torch.Tensor) -> str:
    return base64.b64encode(safetensors.torch.save(tensors)).decode()


def test_kwargs_data_round_trip(processor: MediaProcessor) -> None:
    item = processor.process_bytes(png(noise(70, 90)))
    back = processor.decode_kwargs_data(processor.encode_kwargs_data(item))
    assert torch.equal(back.pixel_values, item.pixel_values)
    assert torch.equal(back.image_grid_thw, item.image_grid_thw)
    assert back.num_placeholder_tokens == item.num_placeholder_tokens
    # Named by its tensors, never by the bytes' hash a client could claim.
    assert back.content_hash == hash_tensors(
        pixel_values=item.pixel_values, image_grid_thw=item.image_grid_thw
    )
    assert back.content_hash != item.content_hash
    for dtype in (torch.float16, torch.bfloat16):  # clients may halve the payload
        small = encode(pixel_values=item.pixel_values.to(dtype), image_grid_thw=item.image_grid_thw)
        assert processor.decode_kwargs_data(small).pixel_values.dtype == torch.float32


def bad_payloads(processor: MediaProcessor) -> list[Any]:
    dim = processor.patch_dim
    good_grid = torch.tensor([[1, 4, 6]])
    pixels = torch.zeros(24, dim)
    nan_pixels = pixels.clone()
    nan_pixels[0, 0] = float("nan")
    return [
        "not base64 !!",
        base64.b64encode(b"definitely not safetensors").decode(),
        base64.b64encode(pickle.dumps({"pixel_values": [1.0]})).decode(),
        encode(pixel_values=pixels),
        encode(pixel_values=pixels, image_grid_thw=good_grid, extra=torch.zeros(1)),
        encode(pixel_values=pixels, image_grid_thw=torch.tensor([1, 4, 6])),
        encode(pixel_values=pixels, image_grid_thw=good_grid.float()),
        encode(pixel_values=torch.zeros(48, dim), image_grid_thw=torch.tensor([[2, 4, 6]])),
        encode(pixel_values=torch.zeros(20, dim), image_grid_thw=torch.tensor([[1, 4, 5]])),
        encode(pixel_values=torch.zeros(0, dim), image_grid_thw=torch.tensor([[1, 0, 6]])),
        encode(pixel_values=torch.zeros(1, dim), image_grid_thw=torch.tensor([[1, 2**20, 2**20]])),
        encode(pixel_values=torch.zeros(23, dim), image_grid_thw=good_grid),
        encode(pixel_values=torch.zeros(24, dim - 1), image_grid_thw=good_grid),
        encode(pixel_values=pixels.long(), image_grid_thw=good_grid),
        encode(pixel_values=nan_pixels, image_grid_thw=good_grid),
        encode(pixel_values=torch.full((24, dim), 1e30), image_grid_thw=good_grid),
        "A" * (processor.max_kwargs_chars + 4),
        None,
    ]


def test_kwargs_data_rejects_malformed_payloads(processor: MediaProcessor) -> None:
    for i, payload in enumerate(bad_payloads(processor)):
        with pytest.raises(MediaRefused) as excinfo:
            processor.decode_kwargs_data(payload, index=i)
        assert excinfo.value.status == 400
        assert excinfo.value.message.startswith("invalid multimodal features")


# -- placeholders ----------------------------------------------------------------------------


def test_expand_image_placeholders() -> None:
    ids, ranges = expand_image_placeholders([1, PAD, 2, PAD, 3], PAD, [2, 3])
    assert ids == [1, PAD, PAD, 2, PAD, PAD, PAD, 3]
    assert ranges == [(1, 2), (4, 3)]
    assert expand_image_placeholders([1, 2], PAD, []) == ([1, 2], [])
    for prompt, counts in [([1, PAD, 2], []), ([1, 2], [4]), ([PAD, PAD], [1])]:
        with pytest.raises(MediaRefused) as excinfo:
            expand_image_placeholders(prompt, PAD, counts)
        assert excinfo.value.status == 400


def test_validate_placeholder_ranges() -> None:
    ids = [1, PAD, PAD, 2, PAD, PAD, PAD, 3]
    validate_placeholder_ranges(ids, [(1, 2), (4, 3)], [2, 3], PAD)
    cases = [
        ([(1, 2)], [2, 3]),  # count mismatch
        ([(1, 2), (6, 3)], [2, 3]),  # past the end
        ([(-1, 2), (4, 3)], [2, 3]),  # negative offset
        ([(1, 2), (2, 3)], [2, 3]),  # overlap
        ([(4, 3), (1, 2)], [3, 2]),  # out of order
        ([(1, 2), (4, 2)], [2, 3]),  # length != item tokens
        ([(0, 2), (4, 3)], [2, 3]),  # holds a non-pad id
        ([(1, 2), (5, 2)], [2, 2]),  # a pad outside every range
        ([(1, 0), (4, 3)], [0, 3]),  # empty range
    ]
    for ranges, counts in cases:
        with pytest.raises(MediaRefused) as excinfo:
            validate_placeholder_ranges(ids, ranges, counts, PAD)
        assert excinfo.value.status == 400, (ranges, counts)
