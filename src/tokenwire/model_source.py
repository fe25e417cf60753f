"""Turn ``--model`` (an asset name, a local HF directory or a GGUF file) into a model directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tokenwire import assets


def resolve_model_dir(model: str, progress: Callable[[str], None] | None = None) -> Path:
    if model in assets.ASSET_NAMES:
        return assets.prepare(model, progress=progress)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
        return path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        return assets.convert_gguf(path, progress=progress)
    names = ", ".join(assets.ASSET_NAMES)
    raise ValueError(
        f"--model {model!r} is neither a model directory, a .gguf file nor one of {names}"
    )
