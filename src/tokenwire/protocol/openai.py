"""OpenAI ChatCompletionRequest and CompletionRequest, with vLLM's extra sampling fields."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from tokenwire.protocol.common import (
    CacheSalt,
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
from tokenwire.protocol.generate import SamplingParamsModel, StreamOptions
from tokenwire.protocol.tokenize import ChatTemplateOptions
from tokenwire.structured.spec import (
    constraint_of,
    guided_fields,
    one_of,
    response_format_fields,
)

# Alternatives per token that derender reads back (vLLM's default --max-logprobs).
MAX_TOP_LOGPROBS = 20


class SamplingFields(RequestModel):
    """Sampling fields shared by chat and completion requests."""

    model: str | None = None
    n: NonNegativeInt64 = Field(default=1, ge=1)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Int64 | None = None
    max_tokens: NonNegativeInt64 | None = Field(default=None, ge=1)
    min_tokens: NonNegativeInt64 = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    prompt_logprobs: Int64 | None = Field(default=None, ge=-1)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: CacheSalt | None = None
    priority: Int64 = 0
    request_id: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's: the prompt's and each choice's token ids in the answer, and logprob tokens as
    # "token_id:N" instead of their text.
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # vLLM 0.33's: with --enable-return-routed-experts, each choice's routed_experts starts at
    # this prompt position (ignored by a server that does not capture, as vLLM).
    routed_experts_prompt_start: NonNegativeInt64 = 0
    # Structured outputs (at most one): OpenAI's response_format (text, json_object,
    # json_schema), vLLM's structured_outputs and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Names the field a dialect's constraint came from (Anthropic's output_format, ...).
    _constraint_source: str | None = PrivateAttr(default=None)

    @property
    def requested_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def structured_outputs_fields(self) -> tuple[dict[str, Any] | None, str]:
        """The request's one constraint as vLLM's structured_outputs, and the field it came
        from (several: a ValueError naming them)."""
        sources: dict[str, dict[str, Any] | None] = {
            "response_format": (
                response_format_fields(self.response_format)
                if self.response_format is not None
                else None
            ),
            "structured_outputs": self.structured_outputs,
            "guided_*": guided_fields(
                self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar
            ),
        }
        fields = one_of(sources)
        source = next((name for name, f in sources.items() if f), "structured_outputs")
        return fields, self._constraint_source or source

    def sampling_params(self, *, max_tokens: int, logprobs: int | None) -> SamplingParamsModel:
        """The generate schema's sampling_params for this request."""
        values: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "prompt_logprobs": self.requested_prompt_logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": self.logit_bias,
        }
        structured, source = self.structured_outputs_fields()
        if structured:
            constraint_of(structured, source)  # refused here: the error names the field
            values["structured_outputs"] = structured
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        values.update({k: v for k, v in optional.items() if v is not None})
        return SamplingParamsModel(**values).constrained_by(source)


class ChatCompletionRequest(ChatTemplateOptions, SamplingFields):
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    max_completion_tokens: NonNegativeInt64 | None = Field(default=None, ge=1)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    user: str | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]
DEFAULT_COMPLETION_MAX_TOKENS = 16


class CompletionRequest(SamplingFields):
    prompt: Prompt
    logprobs: int | None = Field(default=None, ge=0)
    # 0 only with ``echo``: the prompt and its logprobs, nothing generated (vLLM's). vLLM's and
    # OpenAI's default is 16 (chat's is what fits); an explicit null is what fits, as vLLM.
    max_tokens: NonNegativeInt64 | None = DEFAULT_COMPLETION_MAX_TOKENS
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True
    user: str | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _bool_logprobs_as_count(cls, value: Any) -> Any:
        # vLLM's lax pydantic takes a chat-style ``true`` (1) or ``false`` (0) here, and trace
        # gateways inject ``true`` into every request.
        return int(value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _non_empty_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and (
            not self.prompt or any(isinstance(p, list) and not p for p in self.prompt)
        ):
            raise ValueError("prompt must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo)")
        if self.suffix:
            raise ValueError("suffix is not supported by tokenwire")
        return self

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt back, nothing generated."""
        return self.echo and self.max_tokens == 0

    @property
    def requested_prompt_logprobs(self) -> int | None:
        """Echoed logprobs include the prompt's, ``logprobs`` of them unless asked otherwise."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request, text or ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]
