"""Size caps on the string work of request templates: filters that refuse before amplifying.

MiniJinja's fuel counts instructions, not the work one instruction does: ``("x" * 1000)|
replace("x", "y" * 100000)`` is a handful of instructions and a 100 MB string, and
``"a"|indent(400000000)`` is one. Request templates get these filters instead, each refusing
(``TemplateLimitExceeded``) before it builds a result over ``max_chars``: ``replace``, ``join``
and ``format`` check the size and then run MiniJinja's own filter, so what they render is
unchanged; ``indent`` and ``tojson`` are this package's (``filters``) with the same check.
What no filter sees (``~`` and ``*`` on strings, which MiniJinja caps at 100 MB, and string
methods such as ``.replace()``) is bounded by the worker process's memory and time caps
(``workers``). Server templates keep the plain filters: they are trusted and fast.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import minijinja

from .errors import ChatTemplateError, TemplateLimitExceeded
from .filters import indent, tojson

# Widths and precisions in a printf-style format: ``"%100000000s"|format(x)`` pads that far.
_FORMAT_NUMBERS = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?")

# MiniJinja's own filters, for ``_builtin``; the same options as the request environment.
_BUILTINS = minijinja.Environment(debug=False, undefined_behavior="lenient", pycompat=True)


def capped_filters(max_chars: int) -> dict[str, Callable[..., Any]]:
    """The request environment's filters, each refusing results over ``max_chars``."""

    def check(size: int, name: str) -> None:
        if size > max_chars:
            raise TemplateLimitExceeded(
                f"request template over the output cap: {name} would make more than "
                f"{max_chars} characters (--request-template-max-chars)"
            )

    def replace(value: Any, *args: Any, **kwargs: Any) -> Any:
        # replace(value, old, new[, count]); wrong arguments fail in MiniJinja's own filter.
        old, new, *rest = [*args, "", ""]
        text, old_text, new_text = _text(value), _text(old), _text(new)
        count = text.count(old_text) if old_text else len(text) + 1
        if rest and isinstance(rest[0], int) and rest[0] >= 0:
            count = min(count, rest[0])
        check(len(text) + count * (len(new_text) - len(old_text)), "replace")
        return _builtin("replace", value, *args, **kwargs)

    def join(value: Any, *args: Any, **kwargs: Any) -> Any:
        joiner = _text(args[0] if args else next(iter(kwargs.values()), ""))
        if isinstance(value, (str, list, tuple, dict)):
            size = 0
            for index, item in enumerate(value):
                size += len(_text(item)) + (len(joiner) if index else 0)
                check(size, "join")
        return _builtin("join", value, *args, **kwargs)

    def format_filter(value: Any, *args: Any, **kwargs: Any) -> Any:
        text = _text(value)
        for match in _FORMAT_NUMBERS.finditer(text):
            for number in match.groups():
                if number:
                    check(int(number[:16]), "format")
        check(len(text) + sum(len(_text(arg)) for arg in args), "format")
        return _builtin("format", value, *args, **kwargs)

    def capped_indent(
        value: Any, width: int | str = 4, first: bool = False, blank: bool = False
    ) -> str:
        if isinstance(value, str):
            check(len(value) + _width(width) * (len(value.splitlines()) + 1), "indent")
        return indent(value, width, first, blank)

    def capped_tojson(value: Any, *args: Any, **kwargs: Any) -> str:
        # tojson(value, ensure_ascii, indent, separators, sort_keys)
        indent_arg = kwargs.get("indent", args[1] if len(args) > 1 else None)
        check(_json_floor(value, _width(indent_arg), max_chars), "tojson")
        text = tojson(value, *args, **kwargs)
        check(len(text), "tojson")
        return text

    return {
        "replace": replace,
        "join": join,
        "format": format_filter,
        "indent": capped_indent,
        "tojson": capped_tojson,
    }


def _width(indent: Any) -> int:
    """The characters one level of ``indent`` / ``tojson(indent=...)`` adds (a count or a
    string; anything else fails in the filter itself)."""
    if isinstance(indent, str):
        return len(indent)
    return max(indent, 0) if isinstance(indent, int) else 0


def _text(value: Any) -> str:
    """A value's text, for size estimates only (``None`` is what undefined arrives as)."""
    if isinstance(value, str):
        return value
    return "" if value is None else str(value)


def _builtin(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
    """MiniJinja's own filter ``name``, so a capped filter renders what the plain one does.

    ``None`` goes in as undefined: a Python filter cannot tell the two apart, and templates
    apply these filters to missing fields far more often than to ``none``.
    """
    context: dict[str, Any] = {f"a{i}": arg for i, arg in enumerate(args)}
    params = list(context)
    for key, arg in kwargs.items():
        if not key.isidentifier():
            raise ChatTemplateError(f"invalid keyword argument {key!r} to {name}")
        context[f"k_{key}"] = arg
        params.append(f"{key}=k_{key}")
    if value is not None:
        context["v"] = value
    return _BUILTINS.eval_expr(f"v|{name}({', '.join(params)})", **context)


def _json_floor(value: Any, pad: int, limit: int) -> int:
    """A lower bound of ``tojson(value)``'s length, counted only until it passes ``limit``.

    Shared references count once per occurrence (``[big] * 1000`` is a thousand of them), as
    they do in the output; the walk stops as soon as the bound is over, so it costs at most
    ``limit`` steps whatever the value.
    """
    size = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack and size <= limit:
        item, depth = stack.pop()
        if isinstance(item, str):
            size += len(item) + 2
        elif isinstance(item, dict):
            size += 2 + len(item) * (4 + pad * (depth + 1))
            for key, child in item.items():
                size += len(_text(key))
                stack.append((child, depth + 1))
        elif isinstance(item, (list, tuple)):
            size += 2 + len(item) * (1 + pad * (depth + 1))
            stack.extend((child, depth + 1) for child in item)
        else:
            size += 1
    return size
