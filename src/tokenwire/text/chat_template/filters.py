"""The Python callables a template gets: transformers' globals and jinja2-exact filters.

Each mirrors what transformers' jinja2 environment does, so MiniJinja renders the same text.
These are the only Python functions a template can call.
"""

from __future__ import annotations

import functools
import json
import json.encoder
from collections.abc import Callable
from contextvars import ContextVar
from datetime import datetime
from typing import Any

from .errors import TemplateRaised


def raise_exception(message: Any) -> None:
    raise TemplateRaised(str(message))


# Set while deciding on the fallback, so both engines see the same clock.
FROZEN_NOW: ContextVar[datetime | None] = ContextVar("FROZEN_NOW", default=None)


def strftime_now(format: str) -> str:
    # ``datetime`` is looked up at call time so tests can freeze the clock.
    return (FROZEN_NOW.get() or datetime.now()).strftime(format)


@functools.lru_cache(maxsize=64)
def _json_encoder(
    ensure_ascii: bool, indent: int | str | None, separators: Any, sort_keys: bool
) -> json.JSONEncoder:
    # Options other than the default come from the template: few, so one encoder each.
    return json.JSONEncoder(
        ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _not_serializable(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _make_default_encoder() -> Callable[[Any], str]:
    """``json.dumps(value, ensure_ascii=False)``, minus its per-call set-up.

    json.dumps builds a new encoder on every call with non-default options (ensure_ascii=False
    is one); reusing the C encoder halves the cost of each ``tojson`` (Qwen3 calls it once per
    tool and per tool call). Without circular-reference markers a cycle ends in RecursionError
    instead of ValueError; both become ChatTemplateError.
    """
    c_make_encoder = getattr(json.encoder, "c_make_encoder", None)
    if c_make_encoder is not None:
        try:
            chunks = c_make_encoder(
                None, _not_serializable, json.encoder.encode_basestring,
                None, ": ", ", ", False, False, True,
            )  # fmt: skip
            if "".join(chunks({"a": [1.5, None]}, 0)) == '{"a": [1.5, null]}':
                return lambda value: "".join(chunks(value, 0))
        except Exception:  # another C signature: keep the portable path
            pass
    return json.JSONEncoder(ensure_ascii=False).encode


_encode_default = _make_default_encoder()


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: ``json.dumps`` without jinja2's HTML escaping."""
    if not ensure_ascii and indent is None and separators is None and not sort_keys:
        return _encode_default(value)
    if isinstance(separators, list):
        separators = tuple(separators)  # MiniJinja hands tuples over as lists
    return _json_encoder(bool(ensure_ascii), indent, separators, bool(sort_keys)).encode(value)


def indent(value: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    """jinja2's ``indent``: MiniJinja's drops a trailing newline and keeps CRLF line ends."""
    indention = width if isinstance(width, str) else " " * width
    text = value + "\n"  # jinja2's quirk for splitlines, and its TypeError for non-strings
    if blank:
        rendered = ("\n" + indention).join(text.splitlines())
    else:
        lines = text.splitlines()
        rendered = lines.pop(0)
        if lines:
            rendered += "\n" + "\n".join(indention + line if line else line for line in lines)
    return indention + rendered if first else rendered


def int_filter(value: Any, default: int = 0, base: int = 10) -> int:
    """jinja2's ``int``: anything unparsable is ``default`` (MiniJinja raises)."""
    try:
        if isinstance(value, str):
            return int(value, base)
        return int(value)
    except (TypeError, ValueError):
        try:
            return int(float(value))
        except (TypeError, ValueError):
            return default


def float_filter(value: Any, default: float = 0.0) -> float:
    """jinja2's ``float``: anything unparsable is ``default`` (MiniJinja raises)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def is_iterable(value: Any) -> bool:
    """jinja2's ``iterable`` test: ``none`` is not iterable (MiniJinja says it is, and
    ``tools is iterable and tools|length`` then fails when no tools are given).

    MiniJinja hands undefined over as ``None`` too, so undefined is not iterable here either
    (jinja2 says it is; templates iterate it to nothing, so output rarely depends on it).
    """
    if value is None:
        return False
    try:
        iter(value)
    except TypeError:
        return False
    return True
