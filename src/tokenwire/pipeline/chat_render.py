"""Chat messages -> prompt text -> prompt ids: the one path of /tokenize (chat form), render and
chat completions.

Messages reach the template as plain dicts, shaped as vLLM shapes them: null or missing content
becomes ``""`` (a tool-call-only assistant turn fed back), tool-call arguments sent as JSON
strings become objects (templates ``tojson`` them), and text-only content lists become one
string unless the template iterates over content parts itself.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from tokenwire.media.prompt import PromptMedia
from tokenwire.media.refs import chat_media_refs
from tokenwire.pipeline.context import ModelRuntime, Pipeline
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.pipeline.offload import run_text_work, text_size
from tokenwire.protocol.chat import ChatMessage, TextPart
from tokenwire.protocol.tokenize import ChatTemplateOptions
from tokenwire.text.chat_template import (
    ChatTemplateError,
    TemplateCompileError,
    TemplateLimitExceeded,
)

UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)
# Names the server passes itself; a request may not override them through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "chat_template",
        "return_dict",
        "return_assistant_tokens_mask",
    }
)
T = TypeVar("T")
# ChatMessage's fields in the model's order (model_dump's).
_MESSAGE_FIELDS = tuple(ChatMessage.model_fields)
_ITERATES_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)")


@dataclass(slots=True)
class RenderedChat:
    text: str
    token_ids: list[int]
    # The messages' images and where their (expanded) placeholders sit; None without media.
    media: PromptMedia | None = None


async def render_chat(
    pipeline: Pipeline,
    runtime: ModelRuntime,
    options: ChatTemplateOptions,
    *,
    add_special_tokens: bool,
) -> RenderedChat:
    """Messages (with their media) -> prompt ids, the path every chat entry point takes.

    Media is fetched and processed first (concurrently, off the event loop), so a text-only model
    refuses it before any template work; then each image's one ``<|image_pad|>`` is expanded to
    the image's token count.
    """
    refs = chat_media_refs(options.messages)
    items = await runtime.media.resolve(refs) if refs else []
    rendered = await render_chat_text(pipeline, runtime, options, add_special_tokens)
    if not refs:
        return rendered
    prompt = runtime.media.expand(rendered.token_ids, items)
    return RenderedChat(text=rendered.text, token_ids=prompt.token_ids, media=prompt)


async def render_chat_text(
    pipeline: Pipeline,
    runtime: ModelRuntime,
    options: ChatTemplateOptions,
    add_special_tokens: bool,
) -> RenderedChat:
    """The template's text and its ids, without media (placeholders stay single tokens)."""
    text = await render_template_text(pipeline, runtime, options)
    token_ids = await run_text_work(
        len(text), lambda: runtime.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    )
    return RenderedChat(text=text, token_ids=token_ids)


async def render_template_text(
    pipeline: Pipeline, runtime: ModelRuntime, options: ChatTemplateOptions
) -> str:
    """The chat template's text for ``options`` (messages, tools, flags, template kwargs).

    The server's template renders in-process (in a thread when the messages are large); a
    request's template in the template worker processes, under their time, memory and output
    caps, so it can neither stall the event loop nor take the server's memory.
    """
    (text,) = await render_template_texts(pipeline, runtime, [options])
    return text


async def render_template_texts(
    pipeline: Pipeline, runtime: ModelRuntime, renders: list[ChatTemplateOptions]
) -> list[str]:
    """``render_template_text`` of each of ``renders`` (which share their template): the
    server's template renders them all in one go (one thread hop, not one each)."""
    return await render_template_texts_then(pipeline, runtime, renders, list)


async def render_template_texts_then(
    pipeline: Pipeline,
    runtime: ModelRuntime,
    renders: list[ChatTemplateOptions],
    then: Callable[[list[str]], T],
) -> T:
    """``then`` of ``render_template_texts``' texts (the CPU work a caller does on them), in
    the same thread hop as the server template's renders: a hop costs 50-150 µs of CPU here."""
    source = _request_template(pipeline, renders[0])
    if source is None:
        # Every input the template reads counts (16 MB of tools render as long as 16 MB of text).
        size = sum(text_size((o.messages, o.tools, o.chat_template_kwargs)) for o in renders)
        # The renders' messages are the same objects (extend's histories): made dicts once.
        converted: dict[int, dict[str, Any]] = {}
        return await run_text_work(
            size,
            lambda: then([_render_server_template(runtime, o, converted) for o in renders]),
        )
    texts = [await _render_request_template(pipeline, runtime, source, o) for o in renders]
    return await run_text_work(sum(map(len, texts)), lambda: then(texts))


def server_template_text(runtime: ModelRuntime, options: ChatTemplateOptions) -> str:
    """The server template's text for ``options``, here and now (CPU work: a caller's thread)."""
    return _render_server_template(runtime, options)


async def _render_request_template(
    pipeline: Pipeline, runtime: ModelRuntime, source: str, options: ChatTemplateOptions
) -> str:
    size = text_size((options.messages, options.tools, options.chat_template_kwargs))
    assert runtime.request_templates is not None  # built whenever request templates are trusted
    messages, tools, kwargs = await run_text_work(size, lambda: _template_inputs(source, options))
    try:
        return await runtime.request_templates.render(
            source,
            messages,
            tools=tools,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            template_kwargs=kwargs,
        )
    except TemplateCompileError as exc:
        raise InvalidRequest(f"Invalid chat template: {exc}", "chat_template") from exc
    except TemplateLimitExceeded as exc:
        raise InvalidRequest(str(exc), "chat_template") from exc
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc), "messages") from exc


def _render_server_template(
    runtime: ModelRuntime,
    options: ChatTemplateOptions,
    converted: dict[int, dict[str, Any]] | None = None,
) -> str:
    template = runtime.chat_template
    if template is None:
        raise InvalidRequest(
            "This model has no chat template; pass --chat-template to the server", "messages"
        )
    messages, tools, kwargs = _template_inputs(template.source, options, converted)
    try:
        return template.render(
            messages,
            tools=tools,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **kwargs,
        )
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc), "messages") from exc


def server_generation_prompt(
    pipeline: Pipeline, runtime: ModelRuntime, options: ChatTemplateOptions
) -> str | None:
    """What ``add_generation_prompt`` appends to every render of ``options``' template under
    its kwargs, where the server's template is proven to only append it
    (``ChatTemplate.appended_generation_prompt``); None for a request's own template."""
    template = runtime.chat_template
    if template is None or _request_template(pipeline, options) is not None:
        return None
    return template.appended_generation_prompt(**_template_kwargs(options))


def _request_template(pipeline: Pipeline, options: ChatTemplateOptions) -> str | None:
    """The request's own template, if it sends one and the server trusts request templates."""
    source = options.chat_template or (options.chat_template_kwargs or {}).get("chat_template")
    if source is None:
        return None
    if not pipeline.config.trust_request_chat_template:
        raise InvalidRequest(UNTRUSTED_TEMPLATE, "chat_template")
    if not isinstance(source, str):
        raise InvalidRequest("chat_template must be a string", "chat_template")
    return source


def _template_inputs(
    source: str, options: ChatTemplateOptions, converted: dict[int, dict[str, Any]] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]:
    """Messages, tools and template kwargs as the template ``source`` gets them; ``converted``
    holds the messages made dicts already, by object, for renders of the server's template
    (no template the server trusts changes its inputs)."""
    kwargs = _template_kwargs(options)
    iterates_content = bool(_ITERATES_CONTENT.search(source))
    if converted is None:
        messages = [_message_for_template(m, iterates_content) for m in options.messages]
    else:
        messages = []
        for message in options.messages:
            data = converted.get(id(message))
            if data is None:
                data = converted[id(message)] = _message_for_template(message, iterates_content)
            messages.append(data)
    tools = (
        [tool.model_dump(exclude_unset=True) for tool in options.tools] if options.tools else None
    )
    return messages, tools, kwargs


def _template_kwargs(options: ChatTemplateOptions) -> dict[str, Any]:
    return {
        key: value
        for key, value in (options.chat_template_kwargs or {}).items()
        if key not in RESERVED_TEMPLATE_KWARGS
    }


def _message_for_template(message: ChatMessage, iterates_content: bool) -> dict[str, Any]:
    data = _text_message_dump(message)
    if data is None:
        data = message.model_dump(exclude_unset=True)
    content = message.content
    if content is None:
        data["content"] = ""
    elif isinstance(content, list):
        if not iterates_content and all(isinstance(part, TextPart) for part in content):
            data["content"] = "\n".join(part.text for part in content if isinstance(part, TextPart))
        else:
            data["content"] = [_part_for_template(part) for part in data["content"]]
    for call in data.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            # Not JSON: the template gets the string as sent.
            with contextlib.suppress(orjson.JSONDecodeError):
                function["arguments"] = orjson.loads(arguments)
    return data


def _text_message_dump(message: ChatMessage) -> dict[str, Any] | None:
    """``message.model_dump(exclude_unset=True)`` where every field it sets is a string (most
    messages of a conversation), built here: pydantic's serializer takes ~1.5 µs a message,
    0.17 ms of a 114-message history every extend. None for any other message."""
    if message.__pydantic_extra__:
        return None
    fields = message.__pydantic_fields_set__
    data = {}
    for name in _MESSAGE_FIELDS:
        if name in fields:
            value = getattr(message, name)
            if type(value) is not str:
                return None
            data[name] = value
    return data if len(data) == len(fields) else None


def _part_for_template(part: dict[str, Any]) -> dict[str, Any]:
    """Media parts become ``{"type": "image"}`` etc., the form HF multimodal templates expect."""
    kind = part.get("type", "")
    if kind == "text":
        return {"type": "text", "text": part.get("text", "")}
    modality = kind.removesuffix("_url")
    return {"type": modality}
