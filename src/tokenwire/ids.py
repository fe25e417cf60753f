"""Random ids: requests' and those of the objects answers name (tool calls, messages...)."""

from __future__ import annotations

import os


def random_hex() -> str:
    """128 random bits as 32 hex digits, the shape of ``uuid.uuid4().hex`` (vLLM's ids), at a
    third of its cost (1.2 against 3.7 µs here: no UUID object), paid by every request. From
    the OS's random source: an id is what an abort names, so no client may guess another's."""
    return os.urandom(16).hex()
