"""A checkpoint directory's tensors, read into memory the tensors own.

safetensors' ``load_file`` maps each file and returns tensors backed by the mapping, whose pages
are read when first touched: by the weight swap, after the file was closed. A file truncated or
rewritten in between (a trainer saving its next step into the same directory) then raises
SIGBUS on that touch, which kills the server. Here each file is read with plain reads into one
buffer, and its size and modification time are compared before and after: a file changed under
the reader is a ``WeightsError`` (a 400) and the old weights stay. A file replaced by a rename
is read whole as it was when opened. The header is checked against the file's size before the
tensor bytes are read, so a file that is not exactly what its header describes costs no memory.
"""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path

import torch

from tokenwire.engine.base import WeightsError
from tokenwire.engine.weight_rules import check_finite

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
    check_finite(tensors, allow_nonfinite=allow_nonfinite, where=f"{file.name}: ")
    return tensors


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """One file's tensors (``read_open_safetensors``)."""
    try:
        with open(file, "rb", buffering=0) as handle:
            return read_open_safetensors(handle, file.name)
    except OSError as exc:
        raise WeightsError(f"{file.name} cannot be read: {exc.strerror}") from exc


def read_open_safetensors(handle: io.RawIOBase, name: str) -> dict[str, torch.Tensor]:
    """An open file's tensors, views of one buffer read from it. The header is read and checked
    first: a file that is not exactly the size its header gives (a small file padded to
    gigabytes, say) is refused before its tensor bytes are read. Messages never quote the
    file's bytes (the file may be one the client had no right to read)."""
    malformed = None
    try:
        before = os.fstat(handle.fileno())
        try:
            layout, data = _read_layout(handle, before.st_size)
        except _Malformed as exc:
            malformed = exc
        after = os.fstat(handle.fileno())
    except OSError as exc:
        raise WeightsError(f"{name} cannot be read: {exc.strerror}") from exc
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
        raise WeightsError(f"{name} changed while it was read; retry once it is written")
    if malformed is not None:
        raise WeightsError(f"{name} is not a readable safetensors file: {malformed}")
    tensors = {}
    for key, (dtype, shape, begin, count) in layout.items():
        if count == 0:
            tensors[key] = torch.empty(shape, dtype=dtype)
        else:
            flat = torch.frombuffer(data, dtype=dtype, count=count, offset=begin)
            tensors[key] = flat.reshape(shape)
    return tensors


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


class _Malformed(ValueError):
    """A file that is not safetensors; the message says why without quoting its bytes."""


# A tensor's place in the data section: dtype, shape, first byte, element count.
_Entry = tuple[torch.dtype, list[int], int, int]


def _read_layout(handle: io.RawIOBase, size: int) -> tuple[dict[str, _Entry], bytearray]:
    """safetensors' layout: an 8-byte little-endian header size, a JSON header naming each
    tensor's dtype, shape and byte range, then the bytes; the data section is read only once
    the header accounts for every byte of the file (``size``)."""
    prefix = read_whole(handle, 8)
    if len(prefix) < 8:
        raise _Malformed("shorter than a safetensors header")
    header_size = int.from_bytes(prefix, "little")
    if header_size > MAX_HEADER_BYTES or 8 + header_size > size:
        raise _Malformed("its header size does not fit in the file")
    raw = read_whole(handle, header_size)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise _Malformed("its header is not JSON") from None
    if not isinstance(header, dict):
        raise _Malformed("its header is not a JSON object")
    layout = {}
    data_size = 0
    for key, info in header.items():
        if key != "__metadata__":
            layout[key], end = _entry(key, info)
            data_size = max(data_size, end)
    if 8 + header_size + data_size != size:
        raise _Malformed("its size is not what its header gives (bytes past its tensors?)")
    data = read_whole(handle, data_size)
    if len(data) < data_size:
        raise _Malformed("it ended early (truncated?)")
    return layout, data


def _entry(key: str, info: object) -> tuple[_Entry, int]:
    """One header entry, checked, and the end of its bytes."""
    if not isinstance(info, dict):
        raise _Malformed(f"{key}: its header entry is not a JSON object")
    name = info.get("dtype")
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise _Malformed(f"{key}: a dtype safetensors does not define")
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if not _ints(shape) or min(shape, default=0) < 0:
        raise _Malformed(f"{key}: its shape is not a list of non-negative integers")
    if not _ints(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise _Malformed(f"{key}: its data_offsets are not a byte range")
    begin, end = offsets
    count = math.prod(shape)
    if end - begin != count * dtype.itemsize:
        raise _Malformed(f"{key}: its byte range does not hold its shape and dtype")
    return (dtype, shape, begin, count), end


def _ints(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    )
