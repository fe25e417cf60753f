"""A prompt with its media: expanded ids, the items that fill the placeholders, render's tensors.

The processor (and torch) load on first use: importing this module stays light for the api layer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from tokenwire.engine.base import ImageInput, MultiModalInput

if TYPE_CHECKING:
    from tokenwire.media.processing import ProcessedMedia

IMAGE_PAD = "<|image_pad|>"


@dataclass(frozen=True, slots=True)
class PromptMedia:
    """A prompt whose image placeholders are expanded, with the items that fill them."""

    token_ids: list[int]
    items: tuple[ProcessedMedia, ...]
    placeholders: tuple[tuple[int, int], ...]

    def engine_input(self) -> MultiModalInput:
        return MultiModalInput(
            images=tuple(
                ImageInput(item.pixel_values, item.image_grid_thw, offset, length)
                for item, (offset, length) in zip(self.items, self.placeholders, strict=True)
            )
        )


def pad_runs(token_ids: Sequence[int], pad: int) -> list[tuple[int, int]]:
    """Maximal runs of ``pad`` as (offset, length)."""
    runs: list[tuple[int, int]] = []
    start = -1
    for index, token in enumerate(token_ids):
        if token == pad:
            if start < 0:
                start = index
        elif start >= 0:
            runs.append((start, index - start))
            start = -1
    if start >= 0:
        runs.append((start, len(token_ids) - start))
    return runs


class EncodedKwargsCache:
    """Render's ``kwargs_data`` of recently rendered items, kept as ready JSON fragments.

    Serialising an image's tensors (safetensors, base64, then orjson scanning the string) costs
    about 25 ms for a 448x448 image, more than the rest of a cached render, and RL loops render
    the same image every turn. Bounded by the bytes of the fragments; ``max_bytes=0`` disables.
    Used from worker threads, hence the lock.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._fragments: OrderedDict[str, tuple[orjson.Fragment, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, item: ProcessedMedia) -> orjson.Fragment:
        with self._lock:
            found = self._fragments.get(item.content_hash)
            if found is not None:
                self._fragments.move_to_end(item.content_hash)
                return found[0]
        from tokenwire.media.processing import MediaProcessor

        data = b'"' + MediaProcessor.encode_kwargs_data(item).encode("ascii") + b'"'
        fragment = orjson.Fragment(data)
        if len(data) <= self.max_bytes:
            with self._lock:
                if item.content_hash not in self._fragments:
                    self._fragments[item.content_hash] = (fragment, len(data))
                    self._bytes += len(data)
                while self._bytes > self.max_bytes:
                    _, (_, size) = self._fragments.popitem(last=False)
                    self._bytes -= size
        return fragment
