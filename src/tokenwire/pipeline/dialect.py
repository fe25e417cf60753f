"""What the Anthropic Messages and OpenAI Responses dialects share: both become a chat request,
checked by the chat route's own model, and read tool calls back from its answer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import orjson
from pydantic import ValidationError

from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.protocol.openai import ChatCompletionRequest


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


def tool_call_ids(message: dict[str, Any]) -> Iterable[str]:
    return (call["id"] for call in message.get("tool_calls") or () if call.get("id"))


def arguments_object(arguments: str | dict[str, Any]) -> Any:
    """A parsed call's arguments (a JSON string) as the JSON value both dialects send back."""
    if isinstance(arguments, str):
        with contextlib.suppress(orjson.JSONDecodeError):
            return orjson.loads(arguments)
    return arguments
