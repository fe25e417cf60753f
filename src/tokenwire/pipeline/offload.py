"""Keep CPU-heavy text work off the event loop when it is big enough to matter.

A thread hop costs tens of microseconds, more than tokenising a short prompt, so small inputs
stay inline and only large ones go to a worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

INLINE_CHARS = 16_384


async def run_text_work(size: int, work: Callable[[], T]) -> T:
    if size <= INLINE_CHARS:
        return work()
    return await asyncio.to_thread(work)
