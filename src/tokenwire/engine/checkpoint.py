"""A checkpoint directory's tensors, read into memory the tensors own.

safetensors' ``load_file`` maps each file and returns tensors backed by the mapping, whose pages
are read when first touched: by the weight swap, after the file was closed. A file truncated or
rewritten in between (a trainer saving its next step into the same directory) then raises
SIGBUS on that touch, which kills the server. Here each file is read with plain reads into one
buffer, and its size and modification time are compared before and after: a file changed under
the reader is a ``WeightsError`` (a 400) and the old weights stay. A file replaced by a rename
is read whole as it was when opened.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from tokenwire.engine.base import WeightsError

# safetensors' own limit on the JSON header.
MAX_HEADER_BYTES = 100 * 2**20
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_checkpoint(weight_dir: Path, *, allow_nonfinite: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a HF checkpoint directory's ``*.safetensors`` files, on the CPU; NaN or
    infinity in a floating tensor is refused unless ``allow_nonfinite`` (every answer would
    be garbage)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(weight_dir):
        tensors.update(read_checkpoint_file(file, allow_nonfinite=allow_nonfinite))
    return tensors


def checkpoint_files(weight_dir: Path) -> list[Path]:
    """A HF checkpoint directory's ``*.safetensors`` files, in order."""
    if not weight_dir.is_dir():
        raise WeightsError(f"{weight_dir} is not a directory")
    files = sorted(weight_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{weight_dir} holds no *.safetensors files")
    return files


def read_checkpoint_file(file: Path, *, allow_nonfinite: bool = False) -> dict[str, torch.Tensor]:
    """One file of a checkpoint (``read_safetensors``), its values checked as
    ``read_checkpoint`` checks them."""
    tensors = read_safetensors(file)
    if not allow_nonfinite:
        refuse_nonfinite(tensors, f"{file.name}: ")
    return tensors


def refuse_nonfinite(tensors: Mapping[str, torch.Tensor], where: str = "") -> None:
    """``WeightsError`` naming the first tensor that holds NaN or infinity (every answer of
    the model would be garbage)."""
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


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """One file's tensors, views of one buffer read while the file was open."""
    try:
        with open(file, "rb", buffering=0) as handle:
            before = os.fstat(handle.fileno())
            data = read_whole(handle, before.st_size)
            after = os.fstat(handle.fileno())
    except OSError as exc:
        raise WeightsError(f"{file.name} cannot be read: {exc.strerror}") from exc
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
        raise WeightsError(f"{file.name} changed while it was read; retry once it is written")
    if len(data) != before.st_size:
        raise WeightsError(f"{file.name} was truncated while it was read")
    try:
        return _tensors(data)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:  # a truncated or foreign file
        raise WeightsError(f"{file.name} is not a readable safetensors file: {exc}") from exc


def read_whole(handle: io.RawIOBase, size: int) -> bytearray:
    """Up to ``size`` bytes of an unbuffered file, fewer if it ends sooner."""
    data = bytearray(size)
    view = memoryview(data)
    done = 0
    while done < size:
        count = handle.readinto(view[done:])
        if not count:
            break
        done += count
    view.release()
    del data[done:]
    return data


def _tensors(data: bytearray) -> dict[str, torch.Tensor]:
    """safetensors' layout: an 8-byte little-endian header size, a JSON header naming each
    tensor's dtype, shape and byte range, then the bytes."""
    if len(data) < 8:
        raise ValueError("shorter than its header size")
    header_size = int.from_bytes(data[:8], "little")
    start = 8 + header_size
    if header_size > MAX_HEADER_BYTES or start > len(data):
        raise ValueError(f"header of {header_size} bytes in a file of {len(data)}")
    header = json.loads(data[8:start])
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{name}: unknown dtype {info['dtype']!r}")
        shape = [int(size) for size in info["shape"]]
        begin, end = (int(offset) for offset in info["data_offsets"])
        count = math.prod(shape)
        if min(shape, default=0) < 0:
            raise ValueError(f"{name}: negative dimension in shape {shape}")
        if not 0 <= begin <= end <= len(data) - start:
            raise ValueError(f"{name}: bytes {begin}..{end} are not in the file (truncated?)")
        if end - begin != count * dtype.itemsize:
            raise ValueError(f"{name}: {end - begin} bytes for shape {shape} of {info['dtype']}")
        if count == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            flat = torch.frombuffer(data, dtype=dtype, count=count, offset=start + begin)
            tensors[name] = flat.reshape(shape)
    return tensors
