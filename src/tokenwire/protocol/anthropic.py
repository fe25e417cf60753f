"""Anthropic Messages request bodies (``/v1/messages``, ``/count_tokens``, ``/render``), as the
``anthropic`` SDK sends them.

Blocks are a tagged union: an unknown block type, or a block without its fields, is a 400 before
anything is rendered. The pipeline turns a request into the chat request the chat route renders.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenwire.protocol.common import (
    BoundedTools,
    NonNegativeInt64,
    RequestModel,
    Temperature,
    ToolSchema,
    TopK,
    TopP,
    UniqueToolNames,
)


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str


class ImageSource(RequestModel):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(RequestModel):
    type: Literal["image"]
    source: ImageSource


class ThinkingBlock(RequestModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(RequestModel):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool = False


ContentBlock = Annotated[
    TextBlock | ImageBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock,
    Field(discriminator="type"),
]


class AnthropicMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(RequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: Annotated[dict[str, Any], ToolSchema]


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, min_length=1)
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(RequestModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: NonNegativeInt64 | None = None


class CountTokensRequest(RequestModel):
    """What decides the prompt: ``/v1/messages/count_tokens`` takes only this."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[AnthropicTool], BoundedTools, UniqueToolNames] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class Thread(RequestModel):
    """``create``: hold this conversation (the session does); ``continue``: go on from
    ``previous_message_id`` with only the new messages."""

    type: Literal["create", "continue"]
    previous_message_id: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _continue_names_a_message(self) -> Thread:
        if (self.type == "continue") != (self.previous_message_id is not None):
            raise ValueError("previous_message_id is sent with type continue, and only then")
        return self


class MessagesRequest(CountTokensRequest):
    max_tokens: NonNegativeInt64 = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    metadata: dict[str, Any] | None = None
    # Structured output: {"type": "json_schema", "schema": {...}}, under either name.
    output_format: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # Continue from an earlier answer, sending only the new messages: honoured on a session's
    # last answer (``pipeline.sessions.continued_head``), else a 400 that names it, with the
    # error code the anthropic SDK acts on (it replays the whole history).
    thread: Thread | None = None


# -- answers (for the OpenAPI document; the pipeline builds them as dicts) -------------------


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class AnthropicUsage(_Answer):
    input_tokens: int
    output_tokens: int


class AnthropicMessageResponse(_Answer):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    # thinking ({thinking, signature}), text ({text}) and tool_use ({id, name, input}) blocks.
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicStreamEvent(_Answer):
    """One event of a stream, sent as ``event: TYPE`` + ``data: {json}``: message_start,
    content_block_start / _delta / _stop, message_delta, message_stop (or error)."""

    type: str


class CountTokensResponse(_Answer):
    input_tokens: int
