"""The rules every engine checks new base-model tensors by before it copies or receives any:
each names a weight the model has, of that weight's shape, in a floating dtype (cast to the
model's on copy, as vLLM's loaders do). A trainer's tensors are checked against it before a
byte of them is received, so a mismatch leaves the old weights whole. Values that arrive whole
(a checkpoint, SGLang's tensors from memory) must be finite unless --allow-nonfinite-weights:
NaN weights sample id 0 at -9999 for every request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from tokenwire.engine.base import WeightsError

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


def check_finite(
    tensors: Mapping[str, torch.Tensor], *, allow_nonfinite: bool, where: str = ""
) -> None:
    """``WeightsError`` naming the first tensor that holds NaN or infinity (``where``: the file
    it came from), unless ``allow_nonfinite``."""
    if allow_nonfinite:
        return
    for name, tensor in tensors.items():
        if not all_finite(tensor):
            raise WeightsError(
                f"{where}{name} holds NaN or infinite values (--allow-nonfinite-weights loads them)"
            )


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or infinity: its min and max, one pass with no temporary
    (``isfinite().all()`` took ten times as long on a 135M-parameter checkpoint)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    if tensor.element_size() == 1:
        tensor = tensor.float()  # float8 has no min/max kernels on CPU
    low, high = torch.aminmax(tensor)
    return bool(low.isfinite() and high.isfinite())
