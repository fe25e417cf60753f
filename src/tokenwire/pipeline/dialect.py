"""What the Anthropic Messages and OpenAI Responses dialects share: both become a chat request,
checked by the chat route's own model, and read tool calls back from its answer."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any, Literal

import orjson
from pydantic import ValidationError

from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.protocol.openai import ChatCompletionRequest
from tokenwire.structured.spec import constraint_of, response_format_fields

if TYPE_CHECKING:
    from tokenwire.pipeline.openai import CompletionRun

DeltaPart = Literal["reasoning", "content", "tool_call"]


def chat_body(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request a dialect's request makes; what it refuses is a 400 naming the field."""
    try:
        return ChatCompletionRequest.model_validate(
            {key: value for key, value in fields.items() if value is not None}
        )
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise InvalidRequest(f"{where}: {error['msg']}", where.split(".")[0]) from exc


def structured_fields(value: Any, source: str) -> dict[str, Any] | None:
    """A dialect's output format (Responses' ``text.format``, Anthropic's ``output_format``)
    as chat's ``structured_outputs``: refused here with a 400 naming ``source``."""
    try:
        fields = response_format_fields(value, source)
        if fields is not None:
            constraint_of(fields, source)
    except ValueError as exc:
        raise InvalidRequest(str(exc), source) from exc
    return fields


def tool_call_ids(message: dict[str, Any]) -> Iterable[str]:
    return (call["id"] for call in message.get("tool_calls") or () if call.get("id"))


def continued_calls(history: list[dict[str, Any]] | None) -> set[str]:
    """The tool calls a request continuing ``history`` (a session's) may answer."""
    return {call_id for message in history or () for call_id in tool_call_ids(message)}


def check_continued_system(history: list[dict[str, Any]], system: str | None, param: str) -> None:
    """A request continuing a session's ``history`` sends its system prompt again (harnesses
    do) or none (Anthropic's threads keep it): a different one cannot extend the recorded ids."""
    recorded = history[0]["content"] if history and history[0]["role"] == "system" else None
    if system is not None and (system or None) != recorded:
        raise InvalidRequest(
            f"{param} differs from the continued session's system prompt, which its recorded "
            "ids hold: send the whole history to change it",
            param,
        )


def uncontinued(param: str) -> InvalidRequest:
    """A stateful form where no session is continued (a render, a count)."""
    return InvalidRequest(
        f"{param} continues a recorded session: only a turn with its X-Session-ID header takes "
        "it (tokenwire keeps answers in sessions only); else send the whole history",
        param,
    )


def arguments_object(arguments: str | dict[str, Any]) -> Any:
    """A parsed call's arguments (a JSON string) as the JSON value both dialects send back."""
    if isinstance(arguments, str):
        with contextlib.suppress(orjson.JSONDecodeError):
            return orjson.loads(arguments)
    return arguments


class ChatDeltas:
    """The chat route's stream read part by part, for a dialect to frame as its own events:
    reasoning text, content text and tool calls in the order they came; ``finish_reason`` is
    the last one a chunk gave."""

    def __init__(self, run: CompletionRun) -> None:
        self.run = run
        self.finish_reason: str | None = None

    async def parts(self) -> AsyncIterator[tuple[DeltaPart, Any]]:
        async for chunk in self.run.chunks():
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if delta.get("reasoning_content"):
                    yield "reasoning", delta["reasoning_content"]
                if delta.get("content"):
                    yield "content", delta["content"]
                for call in delta.get("tool_calls") or ():
                    yield "tool_call", call
                self.finish_reason = choice["finish_reason"] or self.finish_reason
