"""/inference/v1/generate: vLLM's GenerateRequest and GenerateResponse shapes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from tokenwire.ids import random_hex
from tokenwire.protocol.chat import Tool
from tokenwire.protocol.common import (
    INT64_MAX,
    BoundedTools,
    CacheSalt,
    Int64,
    MinP,
    NonNegativeInt64,
    Penalty,
    RepetitionPenalty,
    RequestModel,
    StrictRequestModel,
    Temperature,
    TokenId,
    TopK,
    TopP,
)
from tokenwire.structured.spec import Constraint, constraint_of

CONTENT_PARTS_AND_FEATURES = "content_parts and features are mutually exclusive"
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs; the flag is checked in the pipeline
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids (its sampler's row width)
# A teacher-scoring target: a token id, or -1 padding a short row (scored -inf, as vLLM).
TargetId = Annotated[int, Field(ge=-1, le=INT64_MAX)]

# Fields that would change the tokens but that tokenwire does not implement: refused, not
# silently ignored, when set to anything but their "off" value.
UNSUPPORTED_FIELDS = (
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "logits_processors",
)


class SamplingParamsModel(StrictRequestModel):
    """vLLM's SamplingParams as JSON. Unknown fields are a 400 (a typo must not pass silently)."""

    n: NonNegativeInt64 = Field(default=1, ge=1)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    seed: Int64 | None = None
    max_tokens: NonNegativeInt64 | None = Field(default=None, ge=1)
    min_tokens: NonNegativeInt64 = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    logprobs: Int64 | None = Field(default=None, ge=-1)
    prompt_logprobs: Int64 | None = Field(default=None, ge=-1)
    # None: the server's --logprobs-mode.
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs", "raw", "processed"] | None = None
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    detokenize: bool = True
    # Accepted for compatibility, down to thinking_token_budget: none changes the token ids
    # (skip_special_tokens and include_stop_str_in_output shape output_mode's text only).
    # docs/api.md lists them, with those vLLM would act on.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's RequestOutputKind: 0 CUMULATIVE, 1 DELTA, 2 FINAL_ONLY (TRL sends 2).
    output_kind: Int64 | None = Field(default=None, ge=0, le=2)
    flat_logprobs: bool = False
    routed_experts_prompt_start: Int64 | None = None
    return_routed_experts: bool | None = None
    skip_reading_prefix_cache: bool | None = None
    extra_args: dict[str, Any] | None = None
    truncate_prompt_tokens: Int64 | None = None
    best_of: Int64 | None = None
    repetition_detection: Any = None
    thinking_token_budget: Int64 | None = None
    # Refused when set; see UNSUPPORTED_FIELDS.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None
    # vLLM's structured outputs (``guided_decoding``: its older name): exactly one of json,
    # regex, choice, grammar, json_object (structural_tag is refused), and its options.
    structured_outputs: dict[str, Any] | None = None
    guided_decoding: dict[str, Any] | None = None
    # The request field the constraint came from, for errors (chat's response_format, ...).
    _constraint_source: str = PrivateAttr(default="sampling_params.structured_outputs")
    # At each output position, these ids' logprobs in place of the top k (vLLM's).
    logprob_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_LOGPROB_TOKEN_IDS)
    # Teacher scoring: row i lists the ids to score as prompt token prompt_logprob_start + i + 1
    # (vLLM's; checked against the prompt in ``pipeline.validation``).
    prompt_logprob_token_ids: list[list[TargetId]] | None = None
    prompt_logprob_start: NonNegativeInt64 | None = None

    @field_validator("seed")
    @classmethod
    def _seed_minus_one_is_none(cls, value: int | None) -> int | None:
        return None if value == -1 else value

    @model_validator(mode="after")
    def _check(self) -> SamplingParamsModel:
        for name in UNSUPPORTED_FIELDS:
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by tokenwire")
        if self.guided_decoding:
            if self.structured_outputs:
                raise ValueError("set structured_outputs or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.structured_outputs:
            constraint_of(self.structured_outputs)  # a 400 naming the field, before generating
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are not supported when detokenize is False")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be less than or equal to max_tokens")
        rows = self.prompt_logprob_token_ids
        if rows is not None and not any(rows):
            raise ValueError(
                "prompt_logprob_token_ids must be a non-empty integer array of shape "
                "[num_rows, num_ids]"
            )
        if rows is None and self.prompt_logprob_start is not None:
            raise ValueError("prompt_logprob_start requires prompt_logprob_token_ids")
        given = self.logprob_token_ids
        if given and self.logprobs is not None and self.logprobs != len(given):
            raise ValueError(
                "When both logprobs and logprob_token_ids are set, logprobs must equal "
                f"len(logprob_token_ids). Got logprobs={self.logprobs}, "
                f"len(logprob_token_ids)={len(given)}."
            )
        return self

    def constrained_by(self, source: str) -> SamplingParamsModel:
        """Name the request field the constraint came from (in errors about it)."""
        self._constraint_source = source
        return self

    @property
    def constraint_source(self) -> str:
        return self._constraint_source

    @property
    def constraint(self) -> Constraint | None:
        """The structured output constraint (None: free text)."""
        if not self.structured_outputs:
            return None
        return constraint_of(self.structured_outputs, self._constraint_source)

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def num_logprobs(self) -> int | None:
        """-1 means the whole vocabulary in vLLM; the routes turn it into --max-logprobs
        before a job starts (``pipeline.logprob_limit``), MAX_LOGPROBS is the fallback.
        ``logprob_token_ids`` alone asks for logprobs too, one per given id (vLLM's)."""
        if self.logprobs is None:
            return len(self.logprob_token_ids) if self.logprob_token_ids else None
        return MAX_LOGPROBS if self.logprobs < 0 else self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is None:
            return None
        return MAX_LOGPROBS if self.prompt_logprobs < 0 else self.prompt_logprobs


class StreamOptions(RequestModel):
    include_usage: bool = True
    continuous_usage_stats: bool = False


class PlaceholderRange(RequestModel):
    offset: NonNegativeInt64
    length: NonNegativeInt64 = Field(ge=1)


class MultiModalFeatures(RequestModel):
    mm_hashes: dict[str, list[str]]
    mm_placeholders: dict[str, list[PlaceholderRange]]
    kwargs_data: dict[str, list[str | None]] | None = None


class ContentPart(RequestModel):
    type: Literal["image_url", "audio_url", "video_url"]
    url: str | None = None
    uuid: str | None = None

    @model_validator(mode="after")
    def _needs_url_or_uuid(self) -> ContentPart:
        if self.url is None and self.uuid is None:
            raise ValueError("a content part needs a url or a uuid")
        return self


class ParseContext(RequestModel):
    """What decides how ``output_mode: "derender"`` parses a choice: the tools offered and the
    tool choice, as the chat request that rendered the prompt had them."""

    tools: Annotated[list[Tool], BoundedTools] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None


class GenerateRequest(RequestModel):
    request_id: str = Field(default_factory=random_hex, max_length=256)
    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: SamplingParamsModel
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    features: MultiModalFeatures | None = None
    content_parts: list[ContentPart] | None = None
    cache_salt: CacheSalt | None = None
    priority: Int64 = 0
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM 0.33: "tokens" (ids only), "text" (and each choice's text), "derender" (and each
    # choice's message: content, reasoning, tool calls, as derender gives them).
    output_mode: Literal["tokens", "text", "derender"] = "tokens"
    parse_context: ParseContext | None = None
    # Each choice's sampling support per output token, as ``choices[].sampling_mask``. vLLM
    # switches it on for the whole server (--return-sampling-mask); here per request, under
    # SGLang's name.
    return_sampling_mask: bool = False

    @model_validator(mode="after")
    def _media_one_way(self) -> GenerateRequest:
        if self.content_parts is not None and self.features is not None:
            raise ValueError(CONTENT_PARTS_AND_FEATURES)
        return self
