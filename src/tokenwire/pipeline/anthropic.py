"""Anthropic Messages: a request becomes the chat request the chat route runs (render ->
generate -> derender), and its answer (or stream of chunks) becomes Anthropic's shape.

Only the formatting is Anthropic's: the prompt, the ids, the decoder, the parsers and the finish
rule are the chat route's, so a message and the same chat completion give the same tokens.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import orjson

from tokenwire.ids import random_hex
from tokenwire.pipeline.choice import Choice
from tokenwire.pipeline.context import Pipeline
from tokenwire.pipeline.dialect import (
    ChatDeltas,
    arguments_object,
    chat_body,
    check_continued_system,
    structured_fields,
    tool_call_ids,
    uncontinued,
)
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.pipeline.openai import CompletionRun
from tokenwire.pipeline.prompt_memory import recorded_tools
from tokenwire.pipeline.render import render_chat_request
from tokenwire.pipeline.session_store import Head
from tokenwire.protocol.anthropic import (
    AnthropicMessage,
    CountTokensRequest,
    ImageBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from tokenwire.protocol.openai import ChatCompletionRequest

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Chat finish reasons as Anthropic's stop reasons (a stop string: "stop_sequence").
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_TEXT_DELTAS = {"thinking": "thinking_delta", "text": "text_delta"}


def chat_request(
    body: CountTokensRequest,
    *,
    request_id: str | None = None,
    continued: Head | None = None,
) -> ChatCompletionRequest:
    """The chat request with the same prompt and sampling as ``body``; ``continued``: the
    session head a ``thread`` continues (``body.messages`` are the new ones; its system prompt
    and tools, where the request leaves them out, as a thread keeps them)."""
    if isinstance(body, MessagesRequest) and body.thread is not None and continued is None:
        raise uncontinued("thread")
    history = continued.messages if continued is not None else None
    messages: list[dict[str, Any]] = []
    system = body.system
    text = "\n".join(b.text for b in system) if isinstance(system, list) else system
    if history is not None:
        check_continued_system(history, text, "system")
    elif text:
        messages.append({"role": "system", "content": text})
    # Anthropic's pairing: the user turn after an assistant turn with tool_use blocks answers
    # each of them with a tool_result, and answers nothing else.
    open_calls, calls_at, replied = _open_calls(history), "the continued answer", False
    for index, message in enumerate(body.messages):
        where = f"messages.{index}"
        if message.role == "assistant":
            _check_answered(open_calls, calls_at, replied)
            messages.append(_assistant_message(message, where))
            open_calls, calls_at, replied = set(tool_call_ids(messages[-1])), where, False
        else:
            messages.extend(_user_messages(message, where, open_calls))
            replied = True
    _check_answered(open_calls, calls_at, replied)
    fields: dict[str, Any] = {"messages": messages, "model": body.model, "request_id": request_id}
    if continued is not None and body.tools is None:
        fields["tools"] = recorded_tools(continued.context)
    elif body.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema,
                },
            }
            for tool in body.tools
        ]
    if body.tool_choice is not None:
        choice = body.tool_choice
        if choice.type == "tool":
            if choice.name is None:
                raise InvalidRequest("tool_choice of type tool needs a name", "tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = _TOOL_CHOICES[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if body.thinking is not None and body.thinking.type != "adaptive":
        # Qwen3-style templates switch reasoning with ``enable_thinking``; others ignore it.
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type == "enabled"}
    if body.messages[-1].role == "assistant":
        # A prefilled reply: the model continues it (Anthropic's prefill).
        fields.update(add_generation_prompt=False, continue_final_message=True)
    source = "output_format"
    if isinstance(body, MessagesRequest):
        fields.update(
            max_tokens=body.max_tokens,
            stop=body.stop_sequences,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stream=body.stream,
        )
        output_format = body.output_format
        config_format = (body.output_config or {}).get("format")
        if output_format is not None and config_format is not None:
            raise InvalidRequest(
                "set output_format or output_config.format, not both", "output_format"
            )
        if config_format is not None:
            output_format, source = config_format, "output_config.format"
        if output_format is not None:
            fields["structured_outputs"] = structured_fields(output_format, source)
    request = chat_body(fields)
    request._constraint_source = source
    return request


def _open_calls(history: list[dict[str, Any]] | None) -> set[str]:
    """The tool_use ids of a continued session's last assistant turn that no tool result
    after it answers: what the request's first user turn answers."""
    calls: set[str] = set()
    for message in history or ():
        if message["role"] == "assistant":
            calls = set(tool_call_ids(message))
        elif message["role"] == "tool":
            calls.discard(message.get("tool_call_id"))
    return calls


def _check_answered(open_calls: set[str], calls_at: str, replied: bool) -> None:
    """A user turn followed the calls of ``calls_at`` (an assistant message): it answered them
    all (a final assistant message's calls, a prefill, need no answer)."""
    if replied and open_calls:
        raise InvalidRequest(
            f"{calls_at}: tool_use ids {sorted(open_calls)} have no tool_result in the user "
            "message after them (each tool_use is answered in the next message)",
            "messages",
        )


def _assistant_message(message: AnthropicMessage, where: str) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for position, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": block.input},
                }
            )
        elif not isinstance(block, RedactedThinkingBlock):  # nothing to render: dropped
            raise InvalidRequest(
                f"{where}.content.{position}: a {block.type} block cannot be in an assistant "
                "message",
                "messages",
            )
    result: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        result["reasoning_content"] = "".join(thinking)
    if calls:
        result["tool_calls"] = calls
    return result


def _user_messages(
    message: AnthropicMessage, where: str, open_calls: set[str]
) -> list[dict[str, Any]]:
    """A user message's tool results become tool messages, in order, its other blocks user
    messages between them; each result answers (and closes) one of ``open_calls``."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for position, block in enumerate(message.content):
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in open_calls:
                raise InvalidRequest(
                    f"{where}.content.{position}: tool_result for tool_use id "
                    f"{block.tool_use_id!r}, which the previous assistant message does not have "
                    "(or another tool_result answered)",
                    "messages",
                )
            open_calls.discard(block.tool_use_id)
            if parts:
                messages.append({"role": "user", "content": parts})
                parts = []
            content = block.content
            if not isinstance(content, str):
                content = "\n".join(b.text for b in content if isinstance(b, TextBlock))
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block)}})
        else:
            raise InvalidRequest(
                f"{where}.content.{position}: a {block.type} block cannot be in a user message",
                "messages",
            )
    if parts:
        messages.append({"role": "user", "content": parts})
    return messages


def _image_url(block: ImageBlock) -> str:
    source = block.source
    if source.type == "url" and source.url:
        return source.url
    if source.type == "base64" and source.data and source.media_type:
        return f"data:{source.media_type};base64,{source.data}"
    raise InvalidRequest(
        "an image source needs url (type url) or media_type and data (type base64)", "messages"
    )


def new_message_id() -> str:
    return f"msg_{random_hex()}"


def _stop_fields(choice: Choice, finish_reason: str | None) -> dict[str, Any]:
    if finish_reason == "stop" and isinstance(choice.stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": choice.stop_reason}
    stop_reason = _STOP_REASONS.get(finish_reason or "", "end_turn")
    return {"stop_reason": stop_reason, "stop_sequence": None}


def _header(run: CompletionRun, message_id: str) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": run.pipeline.config.served_name,
    }


def _content_blocks(reply: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.get("reasoning_content"):
        thinking = reply["reasoning_content"]
        blocks.append({"type": "thinking", "thinking": thinking, "signature": signature(thinking)})
    if reply.get("content"):
        blocks.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls") or ():
        function = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": arguments_object(function["arguments"]),
            }
        )
    return blocks


async def message(run: CompletionRun) -> dict[str, Any]:
    """The whole answer: one assistant message."""
    chat = await run.response()
    choice_json = chat["choices"][0]
    return {
        **_header(run, run.job.request_id),
        "content": _content_blocks(choice_json["message"]),
        **_stop_fields(run.job.choices[0], choice_json["finish_reason"]),
        "usage": _usage(run, run.job.completion_tokens),
    }


def _usage(run: CompletionRun, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": run.job.prompt_tokens, "output_tokens": output_tokens}


async def message_events(run: CompletionRun) -> AsyncIterator[dict[str, Any]]:
    """Anthropic's stream: message_start, each content block started, filled and stopped in
    order (thinking, text, tool_use), message_delta with the stop reason, message_stop."""
    start = {**_header(run, run.job.request_id), "content": [], "stop_reason": None}
    start.update(stop_sequence=None, usage=_usage(run, 0))
    yield {"type": "message_start", "message": start}
    blocks = _BlockStream()
    deltas = ChatDeltas(run)
    async for part, value in deltas.parts():
        if part == "tool_call":
            events = blocks.tool_use(value)
        else:
            events = blocks.text("thinking" if part == "reasoning" else "text", value)
        for event in events:
            yield event
    for event in blocks.close():
        yield event
    yield {
        "type": "message_delta",
        "delta": _stop_fields(run.job.choices[0], deltas.finish_reason),
        "usage": {"output_tokens": run.job.completion_tokens},
    }
    yield {"type": "message_stop"}


class _BlockStream:
    """The open content block of a stream; a block of another kind closes it."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self.thinking: list[str] = []  # the open thinking block's text, for its signature

    def text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open != kind:
            events.extend(self.close())
            self.index += 1
            self.open = kind
            block = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""
            events.append(
                {"type": "content_block_start", "index": self.index, "content_block": block}
            )
        if kind == "thinking":
            self.thinking.append(text)
        delta = {"type": _TEXT_DELTAS[kind], kind: text}
        events.append({"type": "content_block_delta", "index": self.index, "delta": delta})
        return events

    def tool_use(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A whole call (the parser hands out complete calls): start, its input, stop."""
        events = self.close()
        self.index += 1
        function = call["function"]
        block = {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}
        arguments = orjson.dumps(arguments_object(function["arguments"])).decode()
        events.append({"type": "content_block_start", "index": self.index, "content_block": block})
        delta = {"type": "input_json_delta", "partial_json": arguments}
        events.append({"type": "content_block_delta", "index": self.index, "delta": delta})
        events.append({"type": "content_block_stop", "index": self.index})
        return events

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":  # as Anthropic streams it: the signature last
            delta = {"type": "signature_delta", "signature": signature("".join(self.thinking))}
            events.append({"type": "content_block_delta", "index": self.index, "delta": delta})
            self.thinking = []
        self.open = None
        return [*events, {"type": "content_block_stop", "index": self.index}]


def signature(thinking: str) -> str:
    """A thinking block's ``signature``: opaque and never empty (pydantic-ai and others take
    an empty one for a block to drop, and rewrite the history). Anthropic's signs the text;
    this one is its hash, and nothing is checked when it comes back."""
    digest = hashlib.sha256(b"tokenwire thinking\0" + thinking.encode()).digest()
    return base64.b64encode(digest).decode()


async def count_tokens(pipeline: Pipeline, body: CountTokensRequest) -> dict[str, Any]:
    """``/v1/messages/count_tokens``: the prompt's length as the messages route renders it."""
    rendered = await render_chat_request(pipeline, chat_request(body))
    return {"input_tokens": len(rendered["token_ids"])}


async def render_messages(pipeline: Pipeline, body: MessagesRequest) -> dict[str, Any]:
    """vLLM 0.33's ``/v1/messages/render``: the GenerateRequest the route would run."""
    return await render_chat_request(pipeline, chat_request(body, request_id=new_message_id()))
