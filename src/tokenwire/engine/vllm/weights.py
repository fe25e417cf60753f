"""Checking a checkpoint before vLLM reloads it in place.

vLLM's in-place reload copies tensors layer by layer into the running model: a checkpoint of
another architecture fails half way and leaves a mix of old and new weights. So a checkpoint
must name the same tensors with the same shapes as the one being served, read from the
safetensors headers (no tensor data is read), before any reload starts. (A trainer's tensors
are checked against the same layout with ``weight_rules``.)
"""

from __future__ import annotations

from pathlib import Path

from tokenwire.engine.base import WeightsError
from tokenwire.engine.checkpoint import checkpoint_files
from tokenwire.engine.weight_rules import Layout


def checkpoint_layout(weight_dir: Path) -> Layout:
    """Every tensor's name and shape in a directory's ``*.safetensors`` files."""
    from safetensors import safe_open

    layout: Layout = {}
    for file in checkpoint_files(weight_dir):
        try:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    layout[name] = tuple(handle.get_slice(name).get_shape())
        except Exception as exc:  # a truncated or foreign file
            raise WeightsError(f"{file.name} is not a readable safetensors file: {exc}") from exc
    return layout


def check_fits(served: Layout, new: Layout) -> None:
    """``WeightsError`` unless ``new`` has exactly the served tensors and shapes."""
    missing = sorted(set(served) - set(new))
    extra = sorted(set(new) - set(served))
    if missing or extra:
        raise WeightsError(
            f"the checkpoint does not match the served model: missing {missing[:3]}, "
            f"unknown {extra[:3]}"
        )
    for name, shape in served.items():
        if new[name] != shape:
            raise WeightsError(f"{name} has shape {list(new[name])}, the model needs {list(shape)}")
