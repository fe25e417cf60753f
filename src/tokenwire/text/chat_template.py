"""Sandboxed chat templates that render exactly like transformers' ``apply_chat_template``.

Templates run in MiniJinja (Rust), not in Python: a template from a request cannot climb from a
string to ``__globals__`` the way jinja2 sandbox escapes do. MiniJinja's Python binding hides
underscore names but would expose the public attributes and methods of any Python object it is
given, so everything a template sees is made of exact builtin types (dict, list, str, numbers;
anything else is rebuilt from those, as transformers does), and the only Python callables it
gets are ``raise_exception``, ``strftime_now`` and a few filters that mirror jinja2's
(``tojson``, ``indent``, ``int``, ``float``, the ``iterable`` test). Fuel bounds the work one
render may do; see ``_exact_builtins`` for what a template can still do to its inputs.

transformers renders with jinja2's ``ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)`` plus loop controls, a ``{% generation %}`` tag, a non-escaping ``tojson``
and those two globals; this module mirrors each of those so the text (and so the token ids) is
identical. A server-configured template MiniJinja cannot render may fall back to that jinja2
set-up (``engine == "jinja2"``); request templates never do.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import json.encoder
import marshal
import re
import sys
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import minijinja

__all__ = ["DEFAULT_FUEL", "ChatTemplate", "ChatTemplateError", "load_model_chat_template"]

# MiniJinja instructions one render may run. A long agentic conversation with the Qwen3 template
# uses well under 1M; 20M is about a second of CPU, which stops runaway loops in a request template.
DEFAULT_FUEL = 20_000_000

_TEMPLATE_NAME = "chat_template"
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Names a message's reasoning is passed under (transformers aliases them to each other).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_REASONING_KEYS = frozenset(_REASONING_FIELDS)
# transformers' AssistantTracker tag renders its body through a call block (a macro scope), so
# ``set`` inside it stays inside. MiniJinja has no such tag; an inline macro plus ``call`` gives the
# same scope, and since no text sits between the new tags, whitespace control is unchanged.
_GENERATION_OPEN = re.compile(r"\{%(-|\+)?\s*generation\s*(-|\+)?%\}")
_GENERATION_CLOSE = re.compile(r"\{%(-|\+)?\s*endgeneration\s*(-|\+)?%\}")


class ChatTemplateError(ValueError):
    """A template failed to compile or render, or called ``raise_exception()``.

    The message is the template's own (or the engine's short description): the api layer
    returns it to the client as a 400.
    """


class _TemplateRaised(Exception):
    """What ``raise_exception()`` throws: minijinja passes Python exceptions through unchanged."""


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


# Set while deciding on the fallback, so both engines see the same clock.
_FROZEN_NOW: ContextVar[datetime | None] = ContextVar("_FROZEN_NOW", default=None)


def _strftime_now(format: str) -> str:
    # ``datetime`` is looked up at call time so tests can freeze the clock.
    return (_FROZEN_NOW.get() or datetime.now()).strftime(format)


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


def _tojson(
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


def _indent(value: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
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


def _int(value: Any, default: int = 0, base: int = 10) -> int:
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


def _float(value: Any, default: float = 0.0) -> float:
    """jinja2's ``float``: anything unparsable is ``default`` (MiniJinja raises)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _is_iterable(value: Any) -> bool:
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


class ChatTemplate:
    """One chat template, compiled once at construction and rendered many times.

    ``allow_jinja2_fallback`` (server-configured templates only): when MiniJinja cannot compile
    the template, or renders a few smoke conversations differently from jinja2, use transformers'
    jinja2 sandbox instead and say so in ``engine``. ``fuel`` caps MiniJinja instructions per
    render (None: no cap).
    """

    engine: Literal["minijinja", "jinja2"]
    source: str
    _renderer: _Renderer

    def __init__(
        self,
        source: str,
        *,
        special_tokens: Mapping[str, str],
        allow_jinja2_fallback: bool = False,
        fuel: int | None = DEFAULT_FUEL,
    ) -> None:
        if not isinstance(source, str):
            raise ChatTemplateError("Chat template must be a string.")
        self.source = source
        self._special_tokens: dict[str, str] = {
            str(key): _checked_text(str(value)) for key, value in special_tokens.items()
        }
        self.engine = "minijinja"
        minijinja_renderer, error = _compile_minijinja(source, fuel)
        if allow_jinja2_fallback:
            jinja2_renderer = _compile_jinja2(source)
            if jinja2_renderer is not None and (
                minijinja_renderer is None
                or not self._renders_alike(minijinja_renderer, jinja2_renderer)
            ):
                self.engine = "jinja2"
                self._renderer = jinja2_renderer
                return
        if minijinja_renderer is None:
            assert error is not None
            raise error
        self._renderer = minijinja_renderer

    def render(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` to prompt text exactly as ``apply_chat_template(tokenize=False)``.

        Raises ChatTemplateError, and nothing else, for any template or input problem. Inputs
        made of plain builtin types reach the template uncopied (see ``_exact_builtins``).
        """
        return self._render_with(
            self._renderer,
            messages,
            tools,
            documents,
            add_generation_prompt,
            continue_final_message,
            template_kwargs,
        )

    # -- internals -------------------------------------------------------------------------

    def _render_with(
        self,
        renderer: _Renderer,
        messages: Any,
        tools: Any,
        documents: Any,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        template_kwargs: dict[str, Any],
    ) -> str:
        try:
            context, final_text = self._prepare(
                messages,
                tools,
                documents,
                add_generation_prompt,
                continue_final_message,
                template_kwargs,
            )
            rendered = renderer(context)
            if final_text is not None:
                rendered = _cut_after_final_message(rendered, final_text)
            return rendered
        except Exception as exc:
            raise _as_template_error(exc) from None
        except BaseException as exc:
            if _is_panic(exc):
                raise ChatTemplateError(f"Chat template engine failed: {exc}") from None
            raise

    def _prepare(
        self,
        messages: Any,
        tools: Any,
        documents: Any,
        add_generation_prompt: bool,
        continue_final_message: bool | str,
        template_kwargs: dict[str, Any],
    ) -> tuple[dict[str, Any], str | None]:
        """Build the template context the way ``apply_chat_template`` and
        ``render_jinja_template`` do, step for step (the order changes the output)."""
        if not isinstance(messages, (list, tuple)):
            raise ChatTemplateError("Chat messages should be a list of dicts.")
        if not messages:
            raise ChatTemplateError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt are not compatible. Use "
                "continue_final_message when you want the model to continue the final message, "
                "and add_generation_prompt when you want to add a header that will prompt it to "
                "start a new assistant message instead."
            )
        if tools is not None and (
            not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools)
        ):
            raise ChatTemplateError("Tools should be a list of JSON schemas (dicts).")
        if documents is not None and (
            not isinstance(documents, (list, tuple))
            or not all(isinstance(d, dict) for d in documents)
        ):
            raise ChatTemplateError(
                "Documents should be a list of dicts with 'title' and 'text' keys!"
            )
        # Inputs made only of exact builtin types go to the template as they are (see
        # _exact_builtins); anything else is rebuilt field by field, as transformers does.
        if _exact_builtins((messages, tools, documents, template_kwargs)):
            chat = _chat_messages(messages, exact=True)
            kwargs = template_kwargs
        else:
            chat = _chat_messages(messages, exact=False)
            tools = None if tools is None else _plain(tools)
            documents = None if documents is None else _plain(documents)
            kwargs = _plain(template_kwargs)

        final_text = None
        if continue_final_message:
            final_text = self._tag_final_message(chat, continue_final_message)

        # Special tokens first: template kwargs may override them, as in transformers.
        context: dict[str, Any] = {**self._special_tokens, **kwargs}
        context["messages"] = chat
        context["tools"] = tools
        context["documents"] = documents
        context["add_generation_prompt"] = add_generation_prompt
        return context, final_text

    def _tag_final_message(self, chat: list[dict[str, Any]], field: bool | str) -> str:
        """Append transformers' continuation tag to the text to continue; returns that text."""
        field = field if isinstance(field, str) else "content"
        final = chat[-1].get(field)
        if final is None:
            raise ChatTemplateError(
                f'continue_final_message is set but the final message has no "{field}" to continue!'
            )
        fields = [field]
        if field in _REASONING_FIELDS:
            fields = [name for name in _REASONING_FIELDS if chat[-1].get(name) == final]
        if not any(name in self.source for name in fields):
            raise ChatTemplateError(
                f'continue_final_message is set to "{field}" but this is not an accepted field '
                "in the chat_template"
            )
        # Edit copies: the marshal copy keeps objects the caller shared between messages shared.
        chat[-1] = dict(chat[-1])
        if isinstance(final, (list, tuple)):
            blocks = [dict(b) if type(b) is dict else b for b in final]
            final = chat[-1][field] = blocks if isinstance(final, list) else tuple(blocks)
            for block in reversed(final):
                if "text" in block:
                    final_text = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ChatTemplateError(
                    "continue_final_message is set but we could not find any text to continue "
                    "in the final message!"
                )
        else:
            final_text = final
            for name in fields:
                chat[-1][name] = chat[-1][name] + _CONTINUE_TAG
        if not isinstance(final_text, str):
            raise ChatTemplateError("continue_final_message needs text to continue.")
        return final_text

    def _renders_alike(self, minijinja_renderer: _Renderer, jinja2_renderer: _Renderer) -> bool:
        """Smoke-render small conversations with both engines (clock frozen): a MiniJinja
        failure or a different text where jinja2 succeeds means this template needs jinja2."""
        token = _FROZEN_NOW.set(datetime(2025, 1, 2, 3, 4, 5))
        try:
            for messages, options in _smoke_conversations():
                try:
                    expected = self._render_with(jinja2_renderer, messages, *options, {})
                except ChatTemplateError:
                    continue
                try:
                    if self._render_with(minijinja_renderer, messages, *options, {}) != expected:
                        return False
                except ChatTemplateError:
                    return False
            return True
        finally:
            _FROZEN_NOW.reset(token)


def load_model_chat_template(model_dir: Path) -> str | None:
    """The chat template a HF model directory ships, as transformers picks it.

    Template files win over ``tokenizer_config.json`` (transformers 5 saves them):
    ``chat_template.jinja``, else ``additional_chat_templates/default.jinja``; a list of named
    templates in the config gives its ``default`` entry. (transformers picks a ``tool_use``
    template instead when tools are passed; this returns the default one only.)
    """
    model_dir = Path(model_dir)
    for jinja_file in (
        model_dir / "chat_template.jinja",
        model_dir / "additional_chat_templates" / "default.jinja",
    ):
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
    config_file = model_dir / "tokenizer_config.json"
    if config_file.is_file():
        template = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            return template
        if isinstance(template, list):
            named = {
                item.get("name"): item.get("template")
                for item in template
                if isinstance(item, dict)
            }
            default = named.get("default")
            return default if isinstance(default, str) else None
    return None


# -- environments ------------------------------------------------------------------------------


_Renderer = Callable[[dict[str, Any]], str]


def _compile_minijinja(
    source: str, fuel: int | None
) -> tuple[_Renderer | None, ChatTemplateError | None]:
    try:
        env = _minijinja_environment(_strip_generation_tags(source), fuel)
    except Exception as exc:  # syntax errors and MiniJinja-unsupported syntax alike
        return None, _as_template_error(exc)
    except BaseException as exc:
        if not _is_panic(exc):
            raise
        return None, ChatTemplateError(f"Chat template engine failed: {exc}")
    render_template = env.render_template
    return (lambda context: render_template(_TEMPLATE_NAME, **context)), None


def _compile_jinja2(source: str) -> _Renderer | None:
    try:
        return _jinja2_environment().from_string(source).render
    except Exception:
        return None


def _minijinja_environment(source: str, fuel: int | None) -> minijinja.Environment:
    env = minijinja.Environment(
        debug=False,  # debug errors dump the whole context; messages stay short without it
        fuel=fuel,
        undefined_behavior="lenient",  # jinja2's default Undefined: prints "", errors on .attr
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=False,
        pycompat=True,  # str/dict methods (.strip(), .items(), ...) like Python
        filters={"tojson": _tojson, "indent": _indent, "int": _int, "float": _float},
        tests={"iterable": _is_iterable},
        globals={"raise_exception": _raise_exception, "strftime_now": _strftime_now},
    )
    env.remove_global("debug")  # dumps engine state; jinja2 has no such global
    env.add_template(_TEMPLATE_NAME, source)
    return env


class _TemplateDict:
    """transformers' ``dict`` global: callable, with nothing to climb through."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """transformers' ``namespace``: refuses underscore-prefixed attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}. Please rename the attribute."
            )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body, as in transformers."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's class attribute

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _jinja2_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The environment transformers renders with (trusted server templates only)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
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


# -- inputs ------------------------------------------------------------------------------------


_SCALARS = frozenset((str, int, float, bool, type(None)))
_SURROGATE_BYTES = re.compile(rb"\xed[\xa0-\xbf]")
_DICT_ONLY = {dict}


def _chat_messages(messages: list[Any] | tuple[Any, ...], *, exact: bool) -> list[dict[str, Any]]:
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
    for name in _REASONING_FIELDS:
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
    return {_plain(key): _plain(value) for key, value in message.items() if value is not None}


def _plain(value: Any) -> Any:
    """Rebuild ``value`` from exact JSON types (transformers' ``_plain_template_data``).

    MiniJinja hides underscore names but exposes public attributes and methods of any other
    Python object, so nothing else may reach a template: subclasses lose their methods,
    pydantic models and dataclasses become dicts, anything else an inert ``"<TypeName>"``.
    """
    return value if _exact_builtins(value) else _rebuild(value)


def _exact_builtins(value: Any) -> bool:
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
    return _SURROGATE_BYTES.search(data) is None


def _rebuild(value: Any) -> Any:
    kind = type(value)
    if kind is str:
        return _checked_text(value)
    if kind in _SCALARS:
        return value
    if kind is dict:
        return {_rebuild(key): _rebuild(item) for key, item in value.items()}
    if kind is list:
        return [_rebuild(item) for item in value]
    return _plain_other(value)


def _checked_text(text: str) -> str:
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
        return _checked_text(str.__str__(value))
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


def _cut_after_final_message(rendered: str, final_text: str) -> str:
    """Drop what the template wrote after the continued message (transformers' exact rule)."""
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template! This can happen if the chat template deletes "
            "portions of the final message. Please verify the chat template and final message "
            "in your chat to ensure they are compatible."
        )
    tag_loc = rendered.rindex(tag)
    if rendered[tag_loc : tag_loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:tag_loc]
    return rendered[:tag_loc].rstrip()


def _as_template_error(exc: BaseException) -> ChatTemplateError:
    """The short, client-safe message for any failure inside compile or render."""
    if isinstance(exc, ChatTemplateError):
        return exc
    if isinstance(exc, _TemplateRaised):
        return ChatTemplateError(str(exc))
    if isinstance(exc, minijinja.TemplateError):
        return ChatTemplateError(exc.message)  # "what (in chat_template:LINE)", no context dump
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return ChatTemplateError(f"{exc.message} (line {exc.lineno})")
    if isinstance(exc, jinja2.TemplateError):
        return ChatTemplateError(str(exc))
    if isinstance(exc, RecursionError):
        return ChatTemplateError("Chat template recursed too deeply.")
    return ChatTemplateError(f"Chat template failed: {type(exc).__name__}: {exc}")


def _is_panic(exc: BaseException) -> bool:
    # pyo3's PanicException derives from BaseException, so ``except Exception`` misses it.
    return type(exc).__name__ == "PanicException"


# -- smoke conversations for the fallback decision ------------------------------------------


def _smoke_conversations() -> list[tuple[list[dict[str, Any]], tuple[Any, Any, bool, bool]]]:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    }
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    simple = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What's 2+2?"},
    ]
    with_tools = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "Sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    # (messages, (tools, documents, add_generation_prompt, continue_final_message))
    return [
        (simple, (None, None, True, False)),
        (simple[:3], (None, None, False, False)),
        (simple[:3], (None, None, False, True)),
        (simple[1:], (None, None, True, False)),
        (with_tools, ([tool], None, True, False)),
        ([*simple[:1], *with_tools], ([tool], None, True, False)),
    ]
