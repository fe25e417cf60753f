"""What may reach a template: chat messages normalised as transformers does, builtin types only.

MiniJinja exposes the public attributes and methods of any Python object it is given, so
inputs are checked (cheaply, in C) to be made of exact builtin types, and rebuilt when not.
"""

from __future__ import annotations

import dataclasses
import marshal
import re
import sys
from collections.abc import Mapping
from typing import Any

from .errors import ChatTemplateError

# Names a message's reasoning is passed under (transformers aliases them to each other).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_REASONING_KEYS = frozenset(REASONING_FIELDS)


_SCALARS = frozenset((str, int, float, bool, type(None)))
_SURROGATE_BYTES = re.compile(rb"\xed[\xa0-\xbf]")
_FEW_HITS = 32
_DICT_ONLY = {dict}


def chat_messages(messages: list[Any] | tuple[Any, ...], *, exact: bool) -> list[dict[str, Any]]:
    """transformers' normalisation: objects to dicts, top-level ``None`` values dropped, plain
    JSON types only, then reasoning aliased under every name templates read.

    ``exact``: ``messages`` is already made of exact builtin types only.
    """
    if not exact or set(map(type, messages)) != _DICT_ONLY:
        messages = [_message_dict(message) for message in messages]
    no_reasoning = _REASONING_KEYS.isdisjoint
    return [
        message
        if no_reasoning(message) and None not in message.values()
        else _normalized_message(message)
        for message in messages
    ]


def _normalized_message(message: dict[str, Any]) -> dict[str, Any]:
    message = {key: value for key, value in message.items() if value is not None}
    for name in REASONING_FIELDS:
        reasoning = message.get(name)
        if reasoning is not None:
            return {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _message_dict(message: Any) -> dict[str, Any]:
    if type(message) is not dict:
        if dataclasses.is_dataclass(message) and not isinstance(message, type):
            message = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
        elif callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        elif isinstance(message, Mapping):
            message = dict(message)
        else:
            raise ChatTemplateError(
                "Chat messages should be dicts, dataclasses or pydantic models, "
                f"but got {type(message).__name__}."
            )
    return {plain(key): plain(value) for key, value in message.items() if value is not None}


def plain(value: Any) -> Any:
    """Rebuild ``value`` from exact JSON types (transformers' ``_plain_template_data``).

    MiniJinja hides underscore names but exposes public attributes and methods of any other
    Python object, so nothing else may reach a template: subclasses lose their methods,
    pydantic models and dataclasses become dicts, anything else an inert ``"<TypeName>"``.
    """
    return value if exact_builtins(value) else _rebuild(value)


def exact_builtins(value: Any) -> bool:
    """Whether ``value`` holds nothing but exact builtin types, checked in C.

    ``marshal`` refuses subclasses and arbitrary objects, which is the check this module
    needs, in a fraction of a Python walk (this runs on every render). It also accepts bytes,
    sets and complex numbers, which JSON input never holds (transformers would show them as
    ``"<bytes>"``-style placeholders), and cyclic input, harmless here: MiniJinja sees Python
    containers through lazy wrappers, and ``tojson`` turns a cycle into an error.

    Such values are not copied. A MiniJinja template can call their public methods, mutating
    ones included (``.append``, ``.update``), which jinja2's sandbox forbids and no real
    template does: pass objects built for the one render (the server builds them per request),
    never ones shared with other threads. This module's own edits (the continuation tag) work
    on copies.
    """
    try:
        data = marshal.dumps(value)
    except (ValueError, RecursionError):
        return False
    # A lone surrogate (which strict JSON parsers refuse) is the one str that is not UTF-8;
    # marshal writes it as ED A0..BF. Binary fields may match too: the walk then decides.
    return not _holds_surrogate_bytes(data)


def _holds_surrogate_bytes(data: bytes) -> bool:
    """Whether ``data`` holds ED A0..BF: the byte search, then each hit's next byte. A long
    conversation has a few ED bytes at most (marshal's lengths), and a regex over all of it
    costs 50x more (0.3 ms on 1.3 MB); text with many (Hangul's lead byte is ED too) goes to
    the regex after the first ``_FEW_HITS``."""
    find, end = data.find, len(data) - 1
    at = find(b"\xed")
    for _ in range(_FEW_HITS):
        if at < 0 or at == end:
            return False
        if 0xA0 <= data[at + 1] <= 0xBF:
            return True
        at = find(b"\xed", at + 1)
    return at >= 0 and _SURROGATE_BYTES.search(data, at) is not None


def _rebuild(value: Any) -> Any:
    kind = type(value)
    if kind is str:
        return checked_text(value)
    if kind in _SCALARS:
        return value
    if kind is dict:
        return {_rebuild(key): _rebuild(item) for key, item in value.items()}
    if kind is list:
        return [_rebuild(item) for item in value]
    return _plain_other(value)


def checked_text(text: str) -> str:
    """Refuse lone surrogates: MiniJinja would garble them (or, in older bindings, hand the
    template the Python str itself, whose ``format`` reaches attributes)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ChatTemplateError(
                "Chat input holds invalid Unicode (a lone surrogate)."
            ) from None
    return text


def _plain_other(value: Any) -> Any:
    if isinstance(value, str):
        return checked_text(str.__str__(value))
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_rebuild(key): _rebuild(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rebuild(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_rebuild(item) for item in value)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic):
        return _rebuild(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _rebuild(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _rebuild(value.model_dump())
    return f"<{type(value).__name__}>"
