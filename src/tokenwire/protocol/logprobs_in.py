"""A client's ``logprobs.content`` (derender input) read into the token-text decoder's columns.

Entries arrive as /inference/v1/generate wrote them: ``{"token": "token_id:N", "token_id": N,
"logprob", "rank", "bytes", "top_logprobs": [...]}``, vLLM's integer form, or placeholders only
(``token_id`` wins when both are there). At 32k positions x 5 alternatives a pydantic model per
entry costs about a second, so each field is read for all entries at once with ``map`` (C loops)
and checked by the set of its types. Only when that finds something wrong does a walk entry by
entry name the first bad one, so the client's 400 still says where.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from itertools import repeat
from operator import itemgetter
from typing import Annotated, Any

from pydantic import WithJsonSchema

from tokenwire.protocol.common import RequestModel
from tokenwire.protocol.openai import MAX_TOP_LOGPROBS
from tokenwire.text.token_text import LogprobInput

_PLACEHOLDER = re.compile(r"token_id:(-?\d+)")
_ABSENT = object()
_NO_TOP: tuple[()] = ()
_ROW_TYPES = frozenset({list, tuple})  # a tuple only as the default for an absent field
_ID_TYPES = frozenset({int})  # not bool
_NUMBER_TYPES = frozenset({int, float})
# Field readers: a KeyError where the field is absent, a TypeError for what is not an object.
_TOKEN_ID = itemgetter("token_id")
_LOGPROB = itemgetter("logprob")
_TOP_LOGPROBS = itemgetter("top_logprobs")
_get = dict.get

# What the OpenAPI document shows for one entry; ``logprob_input`` checks the same shape.
_TOKEN_SCHEMA: dict[str, Any] = {
    "token_id": {"type": "integer", "minimum": 0},
    "token": {"type": "string", "description": "'token_id:N', read when token_id is absent"},
    "logprob": {"type": "number"},
}
_ENTRY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        **_TOKEN_SCHEMA,
        "top_logprobs": {
            "type": "array",
            "maxItems": MAX_TOP_LOGPROBS,
            "items": {"type": "object", "properties": _TOKEN_SCHEMA, "required": ["logprob"]},
        },
    },
    "required": ["logprob"],
}


class LogprobsIn(RequestModel):
    # Raw JSON: ``logprob_input`` reads it into columns.
    content: (
        Annotated[list[Any], WithJsonSchema({"type": "array", "items": _ENTRY_SCHEMA})] | None
    ) = None


def logprob_input(content: list[Any]) -> LogprobInput:
    """The entries as columns; ``ValueError`` naming the first bad entry (client input)."""
    try:
        columns = _columns(content)
    except (KeyError, TypeError, ValueError, OverflowError):
        columns = None
    if columns is None:
        _explain(content)
        raise ValueError("logprobs.content is not valid")
    return columns


def _columns(content: list[Any]) -> LogprobInput | None:
    """Every field of every entry in a few C-level sweeps; None when something is off."""
    token_ids = _ids(content)
    logprobs = _numbers(list(map(_LOGPROB, content)))
    tops = _field(content, "top_logprobs", _TOP_LOGPROBS, _NO_TOP)
    if token_ids is None or logprobs is None or not set(map(type, tops)) <= _ROW_TYPES:
        return None
    widths = set(map(len, tops))
    if widths and max(widths) > MAX_TOP_LOGPROBS:
        return None
    alternatives = list(itertools.chain.from_iterable(tops))
    alt_ids = _ids(alternatives)
    alt_logprobs = _numbers(list(map(_LOGPROB, alternatives)))
    if alt_ids is None or alt_logprobs is None:
        return None
    if len(widths) > 1:  # rows of different widths (rare): slice them one by one
        bounds = list(itertools.accumulate(map(len, tops), initial=0))
        spans = list(itertools.pairwise(bounds))
        return LogprobInput(
            token_ids,
            logprobs,
            [alt_ids[start:end] for start, end in spans],
            [alt_logprobs[start:end] for start, end in spans],
        )
    width = widths.pop() if widths else 0
    return LogprobInput(
        token_ids,
        logprobs,
        _rows(alt_ids, width, len(content)),
        _rows(alt_logprobs, width, len(content)),
    )


def _field(entries: list[Any], key: str, getter: itemgetter, default: Any) -> list[Any]:
    """``key`` of every entry, ``default`` where it is absent (the fast sweep first)."""
    try:
        return list(map(getter, entries))
    except KeyError:
        return list(map(_get, entries, repeat(key), repeat(default)))


def _rows(flat: list[Any], width: int, count: int) -> list[Sequence[Any]]:
    """Row-major ``flat`` cut into ``count`` rows of ``width`` (tuples, made in C)."""
    if width == 0:
        return [_NO_TOP] * count
    return list(zip(*[iter(flat)] * width, strict=False))


def _ids(entries: list[Any]) -> list[int] | None:
    try:
        ids = list(map(_TOKEN_ID, entries))
    except KeyError:  # some entries carry only the "token_id:N" placeholder
        ids = [_entry_id(entry, "") for entry in entries]
    if not set(map(type, ids)) <= _ID_TYPES or (ids and min(ids) < 0):
        return None
    return ids


def _numbers(values: list[Any]) -> list[float] | None:
    """Logprobs as floats (JSON integers too, as pydantic's float did); None if not numbers."""
    types = set(map(type, values))
    if not types <= _NUMBER_TYPES:
        return None
    return list(map(float, values)) if int in types else values


def _explain(content: list[Any]) -> None:
    """Raise ``ValueError`` for the first entry that breaks the shape."""
    for position, entry in enumerate(content):
        where = f"logprobs.content.{position}"
        _check(entry, where)
        top = entry.get("top_logprobs", _NO_TOP)
        if not isinstance(top, list | tuple):
            raise ValueError(f"{where}.top_logprobs: must be a list")
        if len(top) > MAX_TOP_LOGPROBS:
            raise ValueError(
                f"{where}.top_logprobs: at most {MAX_TOP_LOGPROBS} alternatives, got {len(top)}"
            )
        for rank, alternative in enumerate(top):
            _check(alternative, f"{where}.top_logprobs.{rank}")


def _check(entry: Any, where: str) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be an object")
    _entry_id(entry, where)
    logprob = entry.get("logprob", _ABSENT)
    if logprob is _ABSENT:
        raise ValueError(f"{where}.logprob: missing")
    if type(logprob) not in _NUMBER_TYPES:
        raise ValueError(f"{where}.logprob: must be a number")
    try:
        float(logprob)
    except OverflowError:
        raise ValueError(f"{where}.logprob: out of range") from None


def _entry_id(entry: dict[str, Any], where: str) -> int:
    """``token_id``, else the N of a ``"token_id:N"`` token."""
    token_id = entry.get("token_id", _ABSENT)
    if token_id is _ABSENT:
        token = entry.get("token")
        match = _PLACEHOLDER.fullmatch(token) if isinstance(token, str) else None
        if match is None:
            shown = token[:40] if isinstance(token, str) else token
            raise ValueError(
                f"{where}.token: must be 'token_id:N' when token_id is absent, got {shown!r}"
            )
        token_id = int(match.group(1))
    if type(token_id) is not int or token_id < 0:
        raise ValueError(f"{where}.token_id: must be a non-negative integer, got {token_id!r}")
    return token_id
