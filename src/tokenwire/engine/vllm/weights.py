"""Checking a checkpoint, or a trainer's tensors, before vLLM reloads them in place.

vLLM's in-place reload copies tensors layer by layer into the running model: a checkpoint of
another architecture fails half way and leaves a mix of old and new weights. So a checkpoint
must name the same tensors with the same shapes as the one being served, read from the
safetensors headers (no tensor data is read), before any reload starts; tensors from a
trainer's group are checked against the same layout before a byte is received.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenwire.engine.base import WeightsError

if TYPE_CHECKING:
    import torch

Layout = dict[str, tuple[int, ...]]


def checkpoint_layout(weight_dir: Path) -> Layout:
    """Every tensor's name and shape in a directory's ``*.safetensors`` files."""
    from safetensors import safe_open

    if not weight_dir.is_dir():
        raise WeightsError(f"{weight_dir} is not a directory")
    files = sorted(weight_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{weight_dir} holds no *.safetensors files")
    layout: Layout = {}
    for file in files:
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


def check_tensors(
    served: Layout, tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]
) -> None:
    """``WeightsError`` unless each (name, dtype, shape) names a served tensor of that shape in
    a floating dtype (vLLM's loaders cast it to the model's)."""
    unknown: list[str] = []
    for name, dtype, shape in tensors:
        if name not in served:
            unknown.append(name)
        elif tuple(shape) != served[name]:
            raise WeightsError(f"{name} has shape {tuple(shape)}; the model's is {served[name]}")
        elif not dtype.is_floating_point:
            raise WeightsError(f"{name} has dtype {dtype}; the model's weights are floating")
    if unknown:
        raise WeightsError(f"tensors the model does not have: {', '.join(unknown[:5])}")
