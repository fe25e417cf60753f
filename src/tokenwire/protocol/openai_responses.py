"""OpenAI Responses request bodies (``/v1/responses``, ``/v1/responses/render``), as the ``openai``
SDK's ``client.responses.create`` sends them.

``input`` items are a tagged union on ``type`` (a message may leave it out, as the SDK's
"easy" input messages do): an unknown item type is a 400 before anything is rendered.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from tokenwire.protocol.common import (
    BoundedTools,
    EchoedJson,
    NonNegativeInt64,
    RequestModel,
    Temperature,
    ToolSchema,
    TopP,
    UniqueToolNames,
)


class InputText(RequestModel):
    type: Literal["input_text", "output_text"]
    text: str


class InputImage(RequestModel):
    type: Literal["input_image"]
    image_url: str | None = None
    detail: str | None = None


ContentPart = Annotated[InputText | InputImage, Field(discriminator="type")]


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]


class ReasoningText(RequestModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(RequestModel):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None


def _item_type(item: Any) -> str | None:
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    # Echoed in the answer's ``tools``.
    parameters: Annotated[dict[str, EchoedJson], ToolSchema] | None = None
    strict: bool | None = None


class ToolChoiceFunction(RequestModel):
    type: Literal["function"]
    name: str = Field(min_length=1)


# Values the API has for fields accepted without effect (the ``openai`` SDK 3.63's lists; vLLM
# types these fields with the SDK's models, so another value is a 400 there too).
ResponseIncludable = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]
ReasoningSummary = Literal["auto", "concise", "detailed"]


class ReasoningConfig(RequestModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: ReasoningSummary | None = None
    generate_summary: ReasoningSummary | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], BoundedTools, UniqueToolNames] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceFunction | None = None
    max_output_tokens: NonNegativeInt64 | None = Field(default=None, ge=1)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    # Nothing is stored (``store: false`` semantics whatever is asked): the history travels in
    # ``input``, and a ``previous_response_id`` is refused.
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's: up to 16 string pairs (echoed in the answer).
    metadata: (
        dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None
    ) = Field(default=None, max_length=16)
    text: TextConfig | None = None
    # Accepted without effect, with the API's values only.
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[ResponseIncludable] | None = None
    # A prompt template stored at OpenAI: tokenwire has none, so it is a 400 (vLLM's), never a
    # prompt silently built without it.
    prompt: dict[str, Any] | None = None


class TextConfig(RequestModel):
    # Structured output: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
    # "name", "schema", "strict"} (``structured.spec.response_format_fields``).
    format: dict[str, Any] | None = None


# -- answers (for the OpenAPI document; the pipeline builds them as dicts) -------------------


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class ResponseObject(_Answer):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    # reasoning, message and function_call items.
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class ResponseStreamEvent(_Answer):
    """One event of a stream, sent as ``event: TYPE`` + ``data: {json}``, numbered by
    ``sequence_number``: response.created ... response.completed (or .incomplete, or error)."""

    type: str
