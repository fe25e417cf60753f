"""Minimal reader for the key/value metadata section of a GGUF file.

``gguf.GGUFReader`` builds a numpy view for every one of the ~450k strings of a Qwen2
vocabulary and takes about 20 s to open it; this reader parses only the header with
``struct`` and needs well under a second, which keeps the cold build of the tiny Qwen
assets short.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

_SCALARS: dict[int, struct.Struct] = {
    0: struct.Struct("<B"),  # UINT8
    1: struct.Struct("<b"),  # INT8
    2: struct.Struct("<H"),  # UINT16
    3: struct.Struct("<h"),  # INT16
    4: struct.Struct("<I"),  # UINT32
    5: struct.Struct("<i"),  # INT32
    6: struct.Struct("<f"),  # FLOAT32
    7: struct.Struct("<?"),  # BOOL
    10: struct.Struct("<Q"),  # UINT64
    11: struct.Struct("<q"),  # INT64
    12: struct.Struct("<d"),  # FLOAT64
}
_STRING = 8
_ARRAY = 9
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class _Cursor:
    """Sequential little-endian decoder over a byte buffer."""

    def __init__(self, buf: bytes | mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def u32(self) -> int:
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(value)

    def u64(self) -> int:
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(value)

    def string(self) -> str:
        n = self.u64()
        start = self.pos
        self.pos += n
        return bytes(self.buf[start : self.pos]).decode("utf-8")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type = self.u32()
            count = self.u64()
            return [self.value(item_type) for _ in range(count)]
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise ValueError(f"unsupported GGUF value type {vtype}")
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """All metadata key/values of a little-endian GGUF v2/v3 file (tensors are skipped)."""
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        cur = _Cursor(buf)
        cur.pos = 4
        version = cur.u32()
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version} (big-endian?)")
        cur.u64()  # tensor count
        kv_count = cur.u64()
        meta: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cur.string()
            meta[key] = cur.value(cur.u32())
        return meta
