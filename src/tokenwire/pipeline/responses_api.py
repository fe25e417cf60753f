"""OpenAI Responses: a request becomes the chat request the chat route runs (render ->
generate -> derender), its answer a response with reasoning, message and function_call output
items, streamed as the Responses API's events.

Nothing is stored: every request carries its history in ``input`` (``store: false``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from tokenwire.ids import random_hex
from tokenwire.parsers.think import THINK_CLOSE
from tokenwire.pipeline.context import Pipeline
from tokenwire.pipeline.dialect import (
    ChatDeltas,
    chat_body,
    check_continued_system,
    continued_calls,
    structured_fields,
    tool_call_ids,
    uncontinued,
)
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.pipeline.openai import CompletionRun
from tokenwire.pipeline.render import render_chat_request
from tokenwire.protocol.openai import ChatCompletionRequest
from tokenwire.protocol.openai_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputText,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)

NO_CONVERSATION = (
    "conversation is not supported: tokenwire keeps no conversations; send the whole history "
    "in input, or continue a session (X-Session-ID) with previous_response_id"
)

NO_PROMPT = (
    "prompt is not supported: tokenwire keeps no prompt templates; send the instructions and "
    "input themselves"
)


def chat_request(
    body: ResponsesRequest,
    *,
    request_id: str | None = None,
    history: list[dict[str, Any]] | None = None,
) -> ChatCompletionRequest:
    """The chat request with the same prompt and sampling as ``body``; ``history``: the
    session's messages a ``previous_response_id`` continues (``input`` holds the new ones)."""
    if body.conversation is not None:
        raise InvalidRequest(NO_CONVERSATION, "conversation")
    if body.prompt is not None:
        raise InvalidRequest(NO_PROMPT, "prompt")
    if body.previous_response_id is not None and history is None:
        raise uncontinued("previous_response_id")
    messages: list[dict[str, Any]] = []
    if history is not None:
        check_continued_system(history, body.instructions, "instructions")
    elif body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else []
    messages.extend(_messages(items or body.input, continued_calls(history)))  # type: ignore[arg-type]
    if not messages:
        raise InvalidRequest("input must not be empty", "input")
    fields: dict[str, Any] = {
        "messages": messages,
        "model": body.model,
        "request_id": request_id,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.parameters,
                },
            }
            for tool in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = (
            choice
            if isinstance(choice, str)
            else {"type": "function", "function": {"name": choice.name}}
        )
    source = "text.format"
    if body.text is not None and body.text.format is not None:
        fields["structured_outputs"] = structured_fields(body.text.format, source)
    request = chat_body(fields)
    request._constraint_source = source
    return request


def _messages(
    items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem],
    known_calls: set[str],
) -> list[dict[str, Any]]:
    """Chat messages: reasoning, assistant text and function calls in a row are one assistant
    turn; a function_call_output is a tool message answering an earlier call."""
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn being gathered
    for index, item in enumerate(items):
        if isinstance(item, ReasoningItem | FunctionCallItem) or (
            isinstance(item, MessageItem) and item.role == "assistant"
        ):
            starts_turn = turn is None or (
                isinstance(item, ReasoningItem | MessageItem)
                and (turn["content"] or turn.get("tool_calls"))
            )
            if starts_turn:
                turn = {"role": "assistant", "content": ""}
                messages.append(turn)
            assert turn is not None
            _add_to_turn(turn, item)
            known_calls.update(tool_call_ids(turn))
            continue
        turn = None
        if isinstance(item, FunctionCallOutputItem):
            if item.call_id not in known_calls:
                raise InvalidRequest(
                    f"input.{index}: function_call_output for call_id {item.call_id!r}, which "
                    "no earlier function_call has",
                    "input",
                )
            output = item.output
            text = output if isinstance(output, str) else "".join(part.text for part in output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
        else:
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _content(item.content)})
    return messages


def _add_to_turn(
    turn: dict[str, Any], item: MessageItem | FunctionCallItem | ReasoningItem
) -> None:
    if isinstance(item, ReasoningItem):
        parts = item.content if item.content is not None else item.summary
        turn["reasoning_content"] = turn.get("reasoning_content", "") + "".join(
            part.text for part in parts
        )
    elif isinstance(item, FunctionCallItem):
        call = {
            "id": item.call_id,
            "type": "function",
            "function": {"name": item.name, "arguments": item.arguments},
        }
        turn.setdefault("tool_calls", []).append(call)
    else:
        content = _content(item.content)
        turn["content"] += content if isinstance(content, str) else _joined(content)


def _content(content: str | list[Any]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, InputText):
            parts.append({"type": "text", "text": part.text})
        elif part.image_url:
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
        else:
            raise InvalidRequest("an input_image needs an image_url", "input")
    return parts


def _joined(parts: list[dict[str, Any]]) -> str:
    return "".join(part.get("text", "") for part in parts)


def new_response_id() -> str:
    return f"resp_{random_hex()}"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{random_hex()}"


class ResponseRun:
    """One response: the chat run and what the answer echoes of the request."""

    def __init__(self, run: CompletionRun, body: ResponsesRequest) -> None:
        self.run = run
        self.body = body
        self.created_at = int(time.time())

    def envelope(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        body = self.body
        job = self.run.job
        finished = status != "in_progress"
        incomplete = status == "incomplete"
        return {
            "id": job.request_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.run.pipeline.config.served_name,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": None,
            "store": False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": _tool_choice_json(body),
            "tools": [tool.model_dump() for tool in body.tools or ()],
            "text": {"format": _text_format(body)},
            "truncation": "disabled",
            "metadata": body.metadata or {},
            "usage": self._usage(output) if finished else None,
        }

    def _usage(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        job = self.run.job
        reasoning = any(item["type"] == "reasoning" for item in output)
        return {
            "input_tokens": job.prompt_tokens,
            "input_tokens_details": {"cached_tokens": job.cached_tokens},
            "output_tokens": job.completion_tokens,
            "output_tokens_details": {
                "reasoning_tokens": self._reasoning_tokens() if reasoning else 0
            },
            "total_tokens": job.prompt_tokens + job.completion_tokens,
        }

    def _reasoning_tokens(self) -> int:
        """Output ids up to and with the first ``</think>``; all of them when it never came."""
        ids = self.run.job.choices[0].token_ids
        close = self.run.runtime.tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
        for start in range(len(ids) - len(close) + 1):
            if ids[start : start + len(close)] == close:
                return start + len(close)
        return len(ids)

    async def response(self) -> dict[str, Any]:
        chat = await self.run.response()
        choice = chat["choices"][0]
        message = choice["message"]
        output: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            output.append(_reasoning_item(_item_id("rs"), message["reasoning_content"]))
        if message.get("content"):
            output.append(_message_item(_item_id("msg"), message["content"], "completed"))
        for call in message.get("tool_calls") or ():
            output.append(_call_item(_item_id("fc"), call, "completed"))
        return self.envelope(_status(choice["finish_reason"]), output)

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The Responses API's stream: created, in_progress, each output item added, filled
        and done in order, then completed."""
        stream = _EventStream()
        yield stream.event("response.created", response=self.envelope("in_progress", []))
        yield stream.event("response.in_progress", response=self.envelope("in_progress", []))
        deltas = ChatDeltas(self.run)
        async for part, value in deltas.parts():
            if part == "tool_call":
                events = stream.call(value)
            else:
                events = stream.text("reasoning" if part == "reasoning" else "message", value)
            for event in events:
                yield event
        for event in stream.close():
            yield event
        # Always response.completed, its status incomplete when cut by max_output_tokens, as
        # vLLM ends the stream (the SDK's get_final_response() then reads it).
        status = _status(deltas.finish_reason)
        yield stream.event("response.completed", response=self.envelope(status, stream.output))


def _text_format(body: ResponsesRequest) -> dict[str, Any]:
    """The answer's ``text.format``: the request's (its schema enforced), else plain text."""
    given = body.text.format if body.text is not None else None
    return given or {"type": "text"}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _tool_choice_json(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    function = call["function"]
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"] if status == "completed" else "",
        "status": status,
    }


class _EventStream:
    """Numbers the events and keeps the open output item (reasoning or message text)."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: str | None = None
        self.item_id = ""
        self.text_so_far = ""

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    @property
    def _at(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": len(self.output), "content_index": 0}

    def text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open != kind:
            events.extend(self.close())
            self.open, self.item_id, self.text_so_far = kind, _item_id(kind[:3]), ""
            if kind == "reasoning":
                item = _reasoning_item(self.item_id, "")
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = _message_item(self.item_id, None, "in_progress")
                part = _text_part("")
            events.append(
                self.event("response.output_item.added", output_index=len(self.output), item=item)
            )
            events.append(self.event("response.content_part.added", **self._at, part=part))
        self.text_so_far += text
        if kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", **self._at, delta=text))
        else:
            events.append(
                self.event("response.output_text.delta", **self._at, delta=text, logprobs=[])
            )
        return events

    def call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A whole call (the parser hands out complete calls): added, its arguments, done."""
        events = self.close()
        item_id = _item_id("fc")
        index = len(self.output)
        arguments = call["function"]["arguments"]
        at = {"item_id": item_id, "output_index": index}
        events.append(
            self.event(
                "response.output_item.added",
                output_index=index,
                item=_call_item(item_id, call, "in_progress"),
            )
        )
        events.append(self.event("response.function_call_arguments.delta", **at, delta=arguments))
        events.append(
            self.event(
                "response.function_call_arguments.done",
                **at,
                arguments=arguments,
                name=call["function"]["name"],
            )
        )
        item = _call_item(item_id, call, "completed")
        self.output.append(item)
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        text, at = self.text_so_far, self._at
        if self.open == "reasoning":
            item = _reasoning_item(self.item_id, text)
            part = {"type": "reasoning_text", "text": text}
            done = self.event("response.reasoning_text.done", **at, text=text)
        else:
            item = _message_item(self.item_id, text, "completed")
            part = _text_part(text)
            done = self.event("response.output_text.done", **at, text=text, logprobs=[])
        events = [
            done,
            self.event("response.content_part.done", **at, part=part),
            self.event("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        self.open = None
        return events


async def render_response(pipeline: Pipeline, body: ResponsesRequest) -> dict[str, Any]:
    """vLLM 0.33's ``/v1/responses/render``: the GenerateRequest the route would run."""
    return await render_chat_request(pipeline, chat_request(body, request_id=new_response_id()))
