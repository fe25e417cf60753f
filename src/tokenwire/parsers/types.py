"""What parsers produce: the assistant message, streaming deltas and tool calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenwire.ids import random_hex


def make_tool_call_id() -> str:
    """vLLM's id shape, so clients that pattern-match ids keep working."""
    return f"chatcmpl-tool-{random_hex()}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call; ``arguments`` is a JSON string, as in the OpenAI API."""

    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A complete call in a stream, with its position among the choice's calls."""

    index: int
    call: ToolCall

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, **self.call.to_json()}


@dataclass(slots=True)
class AssistantMessage:
    """The non-streaming result; empty strings are ``None``, as vLLM returns them."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Chat message JSON: ``reasoning`` mirrors ``reasoning_content``, no empty calls."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
            message["reasoning"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [call.to_json() for call in self.tool_calls]
        return message


@dataclass(slots=True)
class MessageDelta:
    """What one streaming step adds; joining all steps gives the ``AssistantMessage``."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def is_empty(self) -> bool:
        return self.content is None and self.reasoning_content is None and not self.tool_calls

    def to_json(self) -> dict[str, Any]:
        """Chat delta JSON, only the fields that carry something."""
        delta: dict[str, Any] = {}
        if self.content is not None:
            delta["content"] = self.content
        if self.reasoning_content is not None:
            delta["reasoning_content"] = self.reasoning_content
            delta["reasoning"] = self.reasoning_content
        if self.tool_calls:
            delta["tool_calls"] = [call.to_json() for call in self.tool_calls]
        return delta
