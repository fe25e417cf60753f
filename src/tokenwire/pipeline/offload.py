"""Keep CPU-heavy text work off the event loop when it is big enough to matter.

A thread hop costs 50-150 µs of CPU here, more than tokenising a short prompt, so small work
stays inline and only large work goes to a worker thread, one that a shutdown does not wait for
(``abandonable``): a huge body's tokenisation cannot hold the server's exit.

Work is sized in characters to encode (the tokenizer's ~0.3 µs a character here); other work
converts to those units by what it costs against that (``render_size``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel

from tokenwire.abandonable import run_abandonable

T = TypeVar("T")

# Work up to this size runs on the event loop: ~5 ms of encoding, about what a thread holding
# the GIL (a tokenizer or template call holds it throughout) keeps the loop waiting anyway.
INLINE_CHARS = 16_384
# A chat template's render, in hundredths of a character to encode: MiniJinja writes its inputs
# at ~3 ns a character here (tools' JSON up to ~8 ns), a hundredth of encoding one, and
# converts and walks a message (its fields set: ~4 items as ``text_size`` counts them) in ~5 µs.
# A 68K-token conversation of 113 messages: ~4,400 units (~1 ms): an extend's two renders of
# it stay inline.
_RENDER_CHAR = 1
_RENDER_ITEM = 400


async def run_text_work(size: int, work: Callable[[], T]) -> T:
    """``work()`` inline when ``size`` (characters to encode, or their equivalent) is at most
    ``INLINE_CHARS``, else on a worker thread."""
    if size <= INLINE_CHARS:
        return work()
    return await run_abandonable(work)


def text_size(value: Any, limit: int = INLINE_CHARS) -> int:
    """About how many characters ``value`` holds (its strings, one more per item), counted
    through every field, nested or not (tools, tool calls, template kwargs...), but only until
    the count passes ``limit``: sizing a huge request costs no more than a small one."""
    return _size(value, limit, per_char=100, per_item=100)


def render_size(value: Any, limit: int = INLINE_CHARS) -> int:
    """A chat template's render of ``value`` (messages, tools, kwargs) in ``run_text_work``'s
    units, counted as ``text_size`` counts: a render is ~1/100 of an encode per character, and
    each item it walks weighs 4 characters to encode."""
    return _size(value, limit, per_char=_RENDER_CHAR, per_item=_RENDER_ITEM)


def _size(value: Any, limit: int, per_char: int, per_item: int) -> int:
    """Sum of ``per_char`` a character of ``value``'s strings and ``per_item`` an item (each in
    hundredths of a unit; None is no item), in units, up to just past ``limit``. One stack of
    values filled by ``list.extend`` (not a stack of iterators: 2.4x faster, ~0.1 ms for a
    68K-token conversation's 114 messages)."""
    size = 0
    cap = limit * 100
    stack = [value]
    pop, push = stack.pop, stack.extend
    while stack and size <= cap:
        item = pop()
        if item is None:
            continue
        size += per_item
        if isinstance(item, str):
            size += per_char * len(item)
        elif isinstance(item, dict):
            push(item.keys())
            push(item.values())
        elif isinstance(item, list | tuple):
            push(item)
        elif isinstance(item, BaseModel):
            push(item.__dict__.values())
            if item.__pydantic_extra__:
                push(item.__pydantic_extra__.values())
    return size // 100
