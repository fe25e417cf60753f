"""Keep CPU-heavy text work off the event loop when it is big enough to matter.

A thread hop costs tens of microseconds, more than tokenising a short prompt, so small inputs
stay inline and only large ones go to a worker thread, one that a shutdown does not wait for
(``abandonable``): a huge body's tokenisation cannot hold the server's exit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from pydantic import BaseModel

from tokenwire.abandonable import run_abandonable

T = TypeVar("T")

INLINE_CHARS = 16_384


async def run_text_work(size: int, work: Callable[[], T]) -> T:
    if size <= INLINE_CHARS:
        return work()
    return await run_abandonable(work)


def text_size(value: Any, limit: int = INLINE_CHARS) -> int:
    """About how many characters ``value`` holds (its strings, one more per item), counted
    through every field, nested or not (tools, tool calls, template kwargs...), but only until
    the count passes ``limit``: sizing a huge request costs no more than a small one."""
    size = 0
    pending: list[Iterator[Any]] = [iter((value,))]
    while pending and size <= limit:
        item = next(pending[-1], _END)
        if item is _END:
            pending.pop()
            continue
        size += 1
        if isinstance(item, str):
            size += len(item)
        elif isinstance(item, dict):
            pending.append(iter(item.items()))
        elif isinstance(item, list | tuple):
            pending.append(iter(item))
        elif isinstance(item, BaseModel):
            pending.append(iter(item.__dict__.values()))
            if item.__pydantic_extra__:
                pending.append(iter(item.__pydantic_extra__.values()))
    return size


_END = object()
