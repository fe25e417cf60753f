"""/tokenize and /detokenize bodies (vLLM's shapes)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag, model_validator

from tokenwire.protocol.chat import ChatMessage, Tool
from tokenwire.protocol.common import BoundedTools, Int64, RequestModel

BOTH_GENERATION_FLAGS = (
    "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
)


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class ChatTemplateOptions(RequestModel):
    """The chat fields shared by /tokenize (chat form) and chat render."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], BoundedTools] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_generation_flag(self) -> ChatTemplateOptions:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(BOTH_GENERATION_FLAGS)
        return self


class TokenizeChatRequest(ChatTemplateOptions):
    model: str | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


def _tokenize_form(body: Any) -> str:
    return "chat" if isinstance(body, dict) and "messages" in body else "completion"


TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("chat")]
    | Annotated[TokenizeCompletionRequest, Tag("completion")],
    Discriminator(_tokenize_form),
]


class TokenizeResponse(RequestModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[Int64]


class DetokenizeResponse(RequestModel):
    prompt: str
