"""Logprob JSON, built fast: chat's ``{"content": [...]}`` and the legacy completions shape.

Texts come from ``token_text``; this module only writes them. Chat: per-id JSON heads are
filled lazily once per token table and joined in C with the logprob numbers, which orjson
encodes in one call per column: no per-entry dicts, which is what makes 32k tokens x 5
alternatives cheap. Embed the result with ``orjson.Fragment``. Completions: plain lists and
dicts, each made by one ``map`` over a column (the shape has no per-entry objects to skip).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import orjson

from .token_table import CACHE_LIMIT, DecodeContext, TokenizerLike, TokenTable
from .token_text import LogprobInput, Resolution, TokenTextDecoder, json_logprob

__all__ = ["chat_logprobs_json", "chat_logprobs_json_from", "completion_logprobs_from"]

_TOP_OPEN = b',"top_logprobs":['
_NO_TOP = b',"top_logprobs":[]},'
_ALT_SEP = b"},"
_ALT_END = b"}]},"


def _number_blob(values: Sequence[Any]) -> bytes:
    """orjson's text of a (nested) list of numbers; -inf / NaN (null) become -9999.0.

    Anything but numbers is a ``ValueError``: a string or bool would corrupt the splits.
    """
    blob = orjson.dumps(values)
    if any(mark in blob for mark in (b'"', b"{", b"t", b"f")):
        raise ValueError("logprobs must be numbers")
    if b"null" in blob:
        blob = blob.replace(b"null", b"-9999.0")
    return blob


def _literals(values: Sequence[float], closer: bytes) -> list[bytes]:
    """``<number><closer>`` for each value, from one orjson call and C string operations."""
    if not values:
        return []
    blob = _number_blob(values)[1:-1]
    if b"[" in blob:
        raise ValueError("logprobs must be numbers")
    pieces = (blob + b",").replace(b",", closer + b"\x00").split(b"\x00")
    pieces.pop()
    return pieces


def _row_literals(rows: Sequence[Sequence[float]], width: int) -> list[bytes]:
    """Row-major ``<number><closer>`` pieces of the alternatives' logprobs: ``},`` inside a
    row, ``}]},`` (closing the alternatives and the entry) at its end."""
    blob = _number_blob(rows)[2:-2]  # rows of equal width (checked), one number or more
    if blob.count(b"[") != len(rows) - 1:  # one "],[" between rows, no nested lists
        raise ValueError("logprobs must be numbers")
    # "a,b],[c" -> "a},\0b},\0]},\0[c" -> "a},\0b}]},\0c": ",": "},", row ends: "}]},".
    blob = blob.replace(b",", _ALT_SEP + b"\x00").replace(
        b"]" + _ALT_SEP + b"\x00[", _ALT_END + b"\x00"
    )
    pieces = (blob + _ALT_END).split(b"\x00")
    if len(pieces) != len(rows) * width:
        raise ValueError("logprobs must be numbers")
    return pieces


class _JsonFragments:
    """Per-id JSON heads, filled lazily: ``{"token":"abc","bytes":[97,98,99],"logprob":``.

    An entry is a head and a ``<number><closer>`` piece (closers are constants), so a whole
    response is one ``bytes.join`` over 2 parts per (position, alternative), with one table
    lookup each. ``logprob`` comes last in each object so that the number and what follows it
    form one piece (JSON key order carries no meaning).
    """

    def __init__(self, table: TokenTable) -> None:
        # The table's tuples, not the table: the cache below is keyed weakly by the table.
        self.text, self.raw, self.size = table.text, table.raw, table.size
        self.head: dict[int, bytes] = {}
        self.custom: dict[str, bytes] = {}  # heads for texts that differ from the table's

    def _fill(self, ids: Iterable[int]) -> None:
        text, raw, head, size = self.text, self.raw, self.head, self.size
        for token_id in set(ids).difference(head):
            if type(token_id) is not int or not 0 <= token_id < size:
                raise ValueError(f"token id {token_id} is outside the vocabulary (size {size})")
            head[token_id] = _head(text[token_id], raw[token_id])

    def heads(
        self, ids: Iterable[int], again: Callable[[], Iterable[int]] | None = None
    ) -> list[bytes]:
        """Head of each id; ``ValueError`` for an id outside the vocabulary.

        ``ids`` may be a one-shot iterator; ``again`` then gives the ids a second time.
        """
        pieces = list(map(self.head.get, ids))
        if None in pieces:
            self._fill(again() if again is not None else ids)
            pieces = list(map(self.head.get, again() if again is not None else ids))
        return pieces  # type: ignore[return-value]

    def custom_head(self, token_id: int, text: str) -> bytes:
        key = f"{token_id}\x00{text}"
        piece = self.custom.get(key)
        if piece is None:
            if len(self.custom) > CACHE_LIMIT:
                self.custom.clear()
            piece = self.custom[key] = _head(text, self.raw[token_id])
        return piece

    def content(
        self,
        logprobs: LogprobInput,
        resolution: Resolution,
        width: int | None,
        alt_heads: list[bytes] | None,
    ) -> bytes:
        """The chat ``logprobs`` object: ``{"content":[...]}``.

        ``width``: alternatives per position (None when it varies); ``alt_heads``: heads of
        the alternatives in row-major order.
        """
        ids = logprobs.token_ids
        n = len(ids)
        if n == 0:
            return b'{"content":[]}'
        rows = logprobs.top_ids
        k = width
        if k is None:
            return b'{"content":[' + self._content_ragged(logprobs, resolution) + b"]}"
        stride = 2 * (1 + k)
        parts: list[bytes | None] = [None] * (stride * n)
        parts[0::stride] = self.heads(ids)
        parts[1::stride] = _literals(logprobs.logprobs, _TOP_OPEN if k else _NO_TOP)
        if k and alt_heads is not None and logprobs.top_logprobs is not None:
            # Row-major lists and strided slices: sequential C loops, no zip(*rows).
            literals = _row_literals(logprobs.top_logprobs, k)
            for rank in range(k):
                parts[2 + 2 * rank :: stride] = alt_heads[rank::k]
                parts[3 + 2 * rank :: stride] = literals[rank::k]
        custom = self.custom_head
        chosen_ids = logprobs.token_ids
        for position, piece in resolution.chosen.items():
            parts[position * stride] = custom(chosen_ids[position], piece)
        if rows is not None:
            for position, rank, piece in resolution.top_items():
                parts[position * stride + 2 + 2 * rank] = custom(rows[position][rank], piece)
        first, last = parts[0], parts[-1]
        assert first is not None and last is not None
        parts[0] = b'{"content":[' + first
        parts[-1] = last[:-1] + b"]}"  # no comma after the last entry
        return b"".join(parts)  # type: ignore[arg-type]

    def _content_ragged(self, logprobs: LogprobInput, resolution: Resolution) -> bytes:
        """Positions with different numbers of alternatives: build entry by entry."""
        text, raw = self.text, self.raw
        assert logprobs.top_ids is not None and logprobs.top_logprobs is not None
        logprobs.check_numbers()
        entries = []
        pairs = zip(logprobs.token_ids, logprobs.logprobs, strict=True)
        for i, (token_id, logprob) in enumerate(pairs):
            top = [
                {
                    "token": resolution.top_text(i, rank, text[alt]),
                    "logprob": json_logprob(alt_lp),
                    "bytes": list(raw[alt]),
                }
                for rank, (alt, alt_lp) in enumerate(
                    zip(logprobs.top_ids[i], logprobs.top_logprobs[i], strict=True)
                )
            ]
            entries.append(
                {
                    "token": resolution.chosen.get(i, text[token_id]),
                    "logprob": json_logprob(logprob),
                    "bytes": list(raw[token_id]),
                    "top_logprobs": top,
                }
            )
        return orjson.dumps(entries)[1:-1]


def _head(text: str, data: bytes) -> bytes:
    return (
        b'{"token":'
        + orjson.dumps(text)
        + b',"bytes":'
        + orjson.dumps(list(data))
        + (b',"logprob":')
    )


_FRAGMENTS: weakref.WeakKeyDictionary[TokenTable, _JsonFragments] = weakref.WeakKeyDictionary()


def _fragments(table: TokenTable) -> _JsonFragments:
    """The JSON heads of ``table``, kept as long as the table is."""
    fragments = _FRAGMENTS.get(table)
    if fragments is None:
        fragments = _FRAGMENTS[table] = _JsonFragments(table)
    return fragments


def chat_logprobs_json_from(
    decoder: TokenTextDecoder,
    logprobs: LogprobInput,
    token_ids: Sequence[int] | None = None,
    *,
    context: DecodeContext | None = None,
    final: bool = True,
) -> tuple[bytes, DecodeContext]:
    """The chat ``logprobs`` object of one chunk as JSON bytes, and the decoder state after it.

    ``token_ids``, ``context`` and ``final`` mean what they mean to ``decoder.resolved``.
    """
    width = logprobs.check()
    ids = logprobs.token_ids if token_ids is None else token_ids
    fragments = _fragments(decoder.table)
    alt_heads = None
    if width and logprobs.top_ids is not None:
        # Looking the heads up first also checks the ids (unknown ids have no head).
        rows = logprobs.top_ids
        alt_heads = fragments.heads(
            itertools.chain.from_iterable(rows), lambda: itertools.chain.from_iterable(rows)
        )
    elif logprobs.top_ids is not None:
        decoder.table.check_ids(list(itertools.chain.from_iterable(logprobs.top_ids)))
    resolution = decoder.resolve(
        ids,
        logprobs.token_ids,
        logprobs.top_ids,
        context=context,
        final=final,
        top_ids_checked=True,
    )
    return fragments.content(logprobs, resolution, width, alt_heads), resolution.context


def chat_logprobs_json(
    tokenizer: TokenizerLike,
    token_ids: Sequence[int],
    logprobs: LogprobInput,
    prompt_token_ids: Sequence[int] | None = None,
    *,
    final: bool = True,
) -> bytes:
    """The chat ``logprobs`` object (``{"content": [...]}``) of one choice as JSON bytes."""
    decoder = TokenTextDecoder(tokenizer)
    context = decoder.context_from_prompt(prompt_token_ids)
    body, _ = chat_logprobs_json_from(decoder, logprobs, token_ids, context=context, final=final)
    return body


def completion_logprobs_from(
    decoder: TokenTextDecoder,
    logprobs: LogprobInput,
    token_ids: Sequence[int] | None = None,
    *,
    context: DecodeContext | None = None,
    final: bool = True,
    text_offset: int = 0,
) -> tuple[dict[str, Any], DecodeContext]:
    """The completions ``logprobs`` object of one chunk, and the decoder state after it.

    ``{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}``, the
    offsets counted from ``text_offset``; alternatives with equal texts share one key (the last
    logprob wins), as a dict built alternative by alternative would.
    """
    width = logprobs.check()
    logprobs.check_numbers()
    ids = logprobs.token_ids if token_ids is None else token_ids
    rows = logprobs.top_ids
    resolution = decoder.resolve(ids, logprobs.token_ids, rows, context=context, final=final)
    text = decoder.table.text
    tokens = list(map(text.__getitem__, logprobs.token_ids))
    for position, piece in resolution.chosen.items():
        tokens[position] = piece
    offsets = list(itertools.accumulate(map(len, tokens), initial=text_offset))
    offsets.pop()
    top_logprobs = logprobs.top_logprobs
    if rows is None or top_logprobs is None:
        top: list[dict[str, float]] = [{} for _ in tokens]
    else:
        text_rows: list[Sequence[str]]
        if width is None:  # rows of different widths (rare)
            text_rows = [list(map(text.__getitem__, row)) for row in rows]
        elif width:  # one lookup sweep, cut into rows in C
            flat = list(map(text.__getitem__, itertools.chain.from_iterable(rows)))
            text_rows = list(zip(*[iter(flat)] * width, strict=False))
        else:
            text_rows = [()] * len(rows)
        for position, rank, piece in resolution.top_items():
            row = list(text_rows[position])
            row[rank] = piece
            text_rows[position] = row
        if not all(map(math.isfinite, itertools.chain.from_iterable(top_logprobs))):
            top_logprobs = [list(map(json_logprob, row)) for row in top_logprobs]
        top = list(map(dict, map(zip, text_rows, top_logprobs)))
    chosen = logprobs.logprobs
    if not all(map(math.isfinite, chosen)):
        chosen = list(map(json_logprob, chosen))
    result = {
        "tokens": tokens,
        "token_logprobs": chosen,
        "top_logprobs": top,
        "text_offset": offsets,
    }
    return result, resolution.context
