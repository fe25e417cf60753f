"""SGLang's native ``/generate`` body, as slime, AReaL and verl's SGLang path send it."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from tokenwire.protocol.common import (
    INT64_MAX,
    Int64,
    MinP,
    NonNegativeInt64,
    Penalty,
    RepetitionPenalty,
    RequestModel,
    Temperature,
    TokenId,
    TopK,
    TopP,
)

# SGLang's default when a request names no max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 128


class SGLangSamplingParams(RequestModel):
    max_new_tokens: NonNegativeInt64 | None = Field(default=DEFAULT_MAX_NEW_TOKENS, ge=1)
    min_new_tokens: NonNegativeInt64 = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    sampling_seed: Int64 | None = None
    n: int = Field(default=1, ge=1, le=1)


class SGLangGenerateRequest(RequestModel):
    text: str | list[Any] | None = None
    input_ids: list[Any] | None = None
    sampling_params: SGLangSamplingParams = Field(default_factory=SGLangSamplingParams)
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0)
    return_text_in_logprobs: bool = False
    rid: str | None = Field(default=None, max_length=256)
    stream: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> SGLangGenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("send exactly one of text and input_ids")
        if isinstance(self.text, list) or (
            self.input_ids is not None and any(isinstance(i, list) for i in self.input_ids)
        ):
            raise ValueError("batched prompts are not supported: send one prompt per request")
        if self.input_ids is not None and not all(
            type(i) is int and 0 <= i <= INT64_MAX for i in self.input_ids
        ):
            raise ValueError("input_ids must be non-negative 64-bit integers")
        return self
