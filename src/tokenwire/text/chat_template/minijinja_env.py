"""The MiniJinja environment every template is tried in first (and request templates only)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import minijinja

from .caps import capped_filters
from .errors import ChatTemplateError, as_template_error, is_panic
from .filters import (
    float_filter,
    indent,
    int_filter,
    is_iterable,
    raise_exception,
    strftime_now,
    tojson,
)

_TEMPLATE_NAME = "chat_template"
# transformers' AssistantTracker tag renders its body through a call block (a macro scope), so
# ``set`` inside it stays inside. MiniJinja has no such tag; an inline macro plus ``call`` gives the
# same scope, and since no text sits between the new tags, whitespace control is unchanged.
_GENERATION_OPEN = re.compile(r"\{%(-|\+)?\s*generation\s*(-|\+)?%\}")
_GENERATION_CLOSE = re.compile(r"\{%(-|\+)?\s*endgeneration\s*(-|\+)?%\}")


def compile_minijinja(
    source: str, fuel: int | None, max_chars: int | None = None
) -> tuple[Callable[[dict[str, Any]], str] | None, ChatTemplateError | None]:
    """``max_chars`` (request templates): the amplifying filters refuse results over it."""
    try:
        env = _minijinja_environment(_strip_generation_tags(source), fuel, max_chars)
    except Exception as exc:  # syntax errors and MiniJinja-unsupported syntax alike
        return None, as_template_error(exc)
    except BaseException as exc:
        if not is_panic(exc):
            raise
        return None, ChatTemplateError(f"Chat template engine failed: {exc}")
    render_template = env.render_template
    return (lambda context: render_template(_TEMPLATE_NAME, **context)), None


def _minijinja_environment(
    source: str, fuel: int | None, max_chars: int | None
) -> minijinja.Environment:
    filters = {"tojson": tojson, "indent": indent, "int": int_filter, "float": float_filter}
    if max_chars is not None:
        filters.update(capped_filters(max_chars))
    env = minijinja.Environment(
        debug=False,  # debug errors dump the whole context; messages stay short without it
        fuel=fuel,
        undefined_behavior="lenient",  # jinja2's default Undefined: prints "", errors on .attr
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=False,
        pycompat=True,  # str/dict methods (.strip(), .items(), ...) like Python
        filters=filters,
        tests={"iterable": is_iterable},
        globals={"raise_exception": raise_exception, "strftime_now": strftime_now},
    )
    env.remove_global("debug")  # dumps engine state; jinja2 has no such global
    env.add_template(_TEMPLATE_NAME, source)
    return env


def _strip_generation_tags(source: str) -> str:
    if "generation" not in source:
        return source
    source = _GENERATION_OPEN.sub(
        lambda m: (
            f"{{%{m[1] or ''} macro __generation() %}}{{{{ caller() }}}}{{% endmacro %}}"
            f"{{% call __generation() {m[2] or ''}%}}"
        ),
        source,
    )
    return _GENERATION_CLOSE.sub(lambda m: f"{{%{m[1] or ''} endcall {m[2] or ''}%}}", source)
