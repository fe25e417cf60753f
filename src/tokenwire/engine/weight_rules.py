"""The rule every engine checks new base-model tensors by before it copies or receives any:
each names a weight the model has, of that weight's shape, in a floating dtype (cast to the
model's on copy, as vLLM's loaders do). A trainer's tensors are checked against it before a
byte of them is received, so a mismatch leaves the old weights whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from tokenwire.engine.base import WeightsError

if TYPE_CHECKING:
    import torch

# A model's weights by name: their shapes.
Layout = dict[str, tuple[int, ...]]


def check_tensors(
    served: Mapping[str, tuple[int, ...]],
    tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
) -> None:
    """``WeightsError`` unless each (name, dtype, shape) names a served weight of that shape in
    a floating dtype."""
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
