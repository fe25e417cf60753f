"""/v1/chat/completions/derender and /v1/completions/derender bodies.

The generate response arrives as the client got it from /inference/v1/generate; its logprobs
are read by ``logprobs_in``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from tokenwire.protocol.common import Int64, NonNegativeInt64, RequestModel, TokenId
from tokenwire.protocol.logprobs_in import LogprobsIn
from tokenwire.protocol.openai import ChatCompletionRequest, CompletionRequest


class GenerateChoiceIn(RequestModel):
    index: NonNegativeInt64 = 0
    token_ids: list[TokenId] | None = None
    logprobs: LogprobsIn | None = None
    finish_reason: str | None = None
    # The stop token id or stop string that ended the choice, as generate reports it.
    stop_reason: Int64 | str | None = None


class UsageIn(RequestModel):
    """Token counts as generate reports them; a streamed derender passes them on."""

    prompt_tokens: NonNegativeInt64
    completion_tokens: NonNegativeInt64
    total_tokens: NonNegativeInt64


class GenerateResponseIn(RequestModel):
    request_id: str = ""
    model: str | None = None
    created: Int64 | None = None
    choices: list[GenerateChoiceIn] = Field(min_length=1)
    usage: UsageIn | None = None

    @field_validator("choices")
    @classmethod
    def _token_ids_present(cls, choices: list[GenerateChoiceIn]) -> list[GenerateChoiceIn]:
        for position, choice in enumerate(choices):
            if not choice.token_ids:
                raise ValueError(f"choice {position} has empty or null token_ids")
        return choices


class GenerateChunkIn(RequestModel):
    """One SSE chunk of /inference/v1/generate (stream=true)."""

    request_id: str = ""
    choices: list[GenerateChoiceIn] = Field(default_factory=list)
    usage: UsageIn | None = None


class ChatDerenderRequest(RequestModel):
    model: str | None = None
    stream: Literal[False] = False
    generate_response: GenerateResponseIn
    prompt_tokens: NonNegativeInt64 | None = None
    prompt_token_ids: list[TokenId] | None = None
    chat_request: ChatCompletionRequest | None = None


class ChatDerenderStreamRequest(RequestModel):
    model: str | None = None
    stream: Literal[True]
    generate_chunk: GenerateChunkIn
    stream_state: str | None = None
    prompt_tokens: NonNegativeInt64 | None = None
    prompt_token_ids: list[TokenId] | None = None
    chat_request: ChatCompletionRequest | None = None


class CompletionDerenderRequest(RequestModel):
    model: str | None = None
    stream: Literal[False] = False
    generate_responses: list[GenerateResponseIn] = Field(min_length=1)
    prompt_tokens: list[NonNegativeInt64] | None = None
    prompt_token_ids: list[list[TokenId] | None] | None = None
    completion_request: CompletionRequest | None = None

    @model_validator(mode="after")
    def _lengths_agree(self) -> CompletionDerenderRequest:
        count = len(self.generate_responses)
        for name in ("prompt_tokens", "prompt_token_ids"):
            value = getattr(self, name)
            if value is not None and len(value) != count:
                raise ValueError(
                    f"{name} length ({len(value)}) must equal generate_responses length ({count})"
                )
        return self


def _derender_form(body: Any) -> str:
    return "stream" if isinstance(body, dict) and body.get("stream") is True else "whole"


ChatDerenderBody = Annotated[
    Annotated[ChatDerenderRequest, Tag("whole")]
    | Annotated[ChatDerenderStreamRequest, Tag("stream")],
    Discriminator(_derender_form),
]
