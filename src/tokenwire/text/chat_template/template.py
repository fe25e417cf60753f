"""``ChatTemplate``: one template compiled once, rendered like ``apply_chat_template``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Literal

import orjson

from .errors import ChatTemplateError, TemplateLimitExceeded, as_template_error, is_panic
from .filters import FROZEN_NOW
from .generation_prompt import appends_generation_prompt
from .inputs import REASONING_FIELDS, chat_messages, checked_text, exact_builtins, plain
from .jinja2_env import compile_jinja2, jinja2_environment, smoke_conversations
from .minijinja_env import compile_minijinja

# MiniJinja instructions one render may run. A long agentic conversation with the Qwen3 template
# uses well under 1M; 20M is about a second of CPU, which stops runaway loops in a request template.
DEFAULT_FUEL = 20_000_000
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# The conversation whose two renders give the generation prompt's text (any one would do).
_PROBE = ({"role": "user", "content": "?"},)
# How many kwargs' generation prompts a template keeps (a request's kwargs are few in practice).
_GENERATION_PROMPTS_KEPT = 256


_Renderer = Callable[[dict[str, Any]], str]


class ChatTemplate:
    """One chat template, compiled once at construction and rendered many times.

    ``allow_jinja2_fallback`` (server-configured templates only): when MiniJinja cannot compile
    the template, or renders a few smoke conversations differently from jinja2, use transformers'
    jinja2 sandbox instead and say so in ``engine``. ``fuel`` caps MiniJinja instructions per
    render (None: no cap). ``max_chars`` (request templates) caps the rendered text and each
    amplifying filter's result (``caps``); going over is a ``TemplateLimitExceeded``.
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
        max_chars: int | None = None,
    ) -> None:
        if not isinstance(source, str):
            raise ChatTemplateError("Chat template must be a string.")
        self.source = source
        self.max_chars = max_chars
        self._appends_generation_prompt: bool | None = None  # found on first use
        # appended_generation_prompt's answers by template kwargs (their JSON, keys sorted).
        self._generation_prompts: dict[bytes, str | None] = {}
        self._special_tokens: dict[str, str] = {
            str(key): checked_text(str(value)) for key, value in special_tokens.items()
        }
        self.engine = "minijinja"
        minijinja_renderer, error = compile_minijinja(source, fuel, max_chars)
        if allow_jinja2_fallback:
            jinja2_renderer = compile_jinja2(source)
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
        made of plain builtin types reach the template uncopied (see ``exact_builtins``).
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

    def appended_generation_prompt(self, **template_kwargs: Any) -> str | None:
        """The text ``add_generation_prompt`` appends to every render under ``template_kwargs``
        (any messages, tools, documents), where the template's syntax proves that it only
        appends one (``generation_prompt``); None otherwise, or where a one-message
        conversation does not render. Found as the difference of that conversation's renders
        with and without the flag."""
        if self._appends_generation_prompt is None:
            self._appends_generation_prompt = appends_generation_prompt(
                jinja2_environment(), self.source
            )
        if not self._appends_generation_prompt:
            return None
        # The text depends on the kwargs alone (what the proof shows), so it is found once per
        # kwargs: its two renders and their inputs' checks cost ~0.2 ms, paid by every extend.
        try:
            key = orjson.dumps(template_kwargs, option=orjson.OPT_SORT_KEYS)
        except TypeError:  # not JSON (no request's kwargs): found each time
            return self._generation_prompt(template_kwargs)
        if key not in self._generation_prompts:
            if len(self._generation_prompts) >= _GENERATION_PROMPTS_KEPT:
                self._generation_prompts.clear()
            self._generation_prompts[key] = self._generation_prompt(template_kwargs)
        return self._generation_prompts[key]

    def _generation_prompt(self, template_kwargs: dict[str, Any]) -> str | None:
        probe = [dict(message) for message in _PROBE]
        try:
            with_prompt = self.render(probe, add_generation_prompt=True, **template_kwargs)
            without = self.render(probe, **template_kwargs)
        except ChatTemplateError:
            return None
        # Always so where the syntax proved it; checked, as it costs nothing.
        return with_prompt[len(without) :] if with_prompt.startswith(without) else None

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
            if self.max_chars is not None and len(rendered) > self.max_chars:
                raise TemplateLimitExceeded(
                    f"request template over the output cap: {len(rendered)} > {self.max_chars} "
                    "characters (--request-template-max-chars)"
                )
            if final_text is not None:
                rendered = _cut_after_final_message(rendered, final_text)
            return rendered
        except Exception as exc:
            raise as_template_error(exc) from None
        except BaseException as exc:
            if is_panic(exc):
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
        # exact_builtins); anything else is rebuilt field by field, as transformers does.
        if exact_builtins((messages, tools, documents, template_kwargs)):
            chat = chat_messages(messages, exact=True)
            kwargs = template_kwargs
        else:
            chat = chat_messages(messages, exact=False)
            tools = None if tools is None else plain(tools)
            documents = None if documents is None else plain(documents)
            kwargs = plain(template_kwargs)

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
        if field in REASONING_FIELDS:
            fields = [name for name in REASONING_FIELDS if chat[-1].get(name) == final]
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
        token = FROZEN_NOW.set(datetime(2025, 1, 2, 3, 4, 5))
        try:
            for messages, options in smoke_conversations():
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
            FROZEN_NOW.reset(token)


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
