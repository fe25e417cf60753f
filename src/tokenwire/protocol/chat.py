"""OpenAI chat messages and tools, as clients send them.

Messages are validated enough to reject garbage with a 400, then handed to chat templates as
plain dicts (templates must never see Python objects).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    """Keeps fields we do not model: templates may read them (e.g. ``reasoning_content``)."""

    model_config = ConfigDict(extra="allow")


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ImageURL(_Open):
    url: str
    detail: str | None = None


class ImageURLPart(_Open):
    type: Literal["image_url"]
    image_url: ImageURL
    uuid: str | None = None


class MediaURL(_Open):
    url: str


class AudioURLPart(_Open):
    type: Literal["audio_url"]
    audio_url: MediaURL
    uuid: str | None = None


class VideoURLPart(_Open):
    type: Literal["video_url"]
    video_url: MediaURL
    uuid: str | None = None


class FlatMediaPart(_Open):
    """vLLM's flat forms: ``{"type": "image", "image": url}`` and friends."""

    type: Literal["image", "audio", "video"]
    image: str | None = None
    audio: str | None = None
    video: str | None = None
    uuid: str | None = None


ContentPart = Annotated[
    TextPart | ImageURLPart | AudioURLPart | VideoURLPart | FlatMediaPart,
    Field(discriminator="type"),
]


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, Any]


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Open):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDefinition
