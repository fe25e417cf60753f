"""SGLang's native ``/generate`` body, as slime, AReaL and verl's SGLang path send it."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tokenwire.protocol.common import (
    INT64_MAX,
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

# SGLang's default when a request names no max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 128
# SGLang fields that change the output (constrained decoding, biases, media, adapters, extra
# outputs) and that tokenwire does not implement: a 400 naming the field when set to anything
# but its "off" value, never a 200 that silently ignored it.
UNSUPPORTED_SAMPLING_FIELDS = (
    "structural_tag",
    "stop_regex",
    "logit_bias",
    "custom_params",
)
UNSUPPORTED_FIELDS = (
    "image_data",
    "video_data",
    "audio_data",
    "input_embeds",
    "lora_id",
    "custom_logit_processor",
    "session_params",
    "token_ids_logprob",
    "return_hidden_states",
)


def _refuse_if_set(value: Any, info: ValidationInfo) -> Any:
    if value not in (None, False, "", [], {}):
        raise ValueError(f"{info.field_name} is not supported by tokenwire's /generate")
    return value


class SGLangSamplingParams(RequestModel):
    # 0: score the prompt only (teacher scoring: input logprobs, no output).
    max_new_tokens: NonNegativeInt64 | None = DEFAULT_MAX_NEW_TOKENS
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
    n: NonNegativeInt64 = Field(default=1, ge=1)
    # Structured outputs (at most one): a regex, a JSON schema as JSON text, an EBNF grammar.
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    # Refused when set; see UNSUPPORTED_SAMPLING_FIELDS.
    structural_tag: Any = None
    stop_regex: Any = None
    logit_bias: Any = None
    custom_params: Any = None

    _unsupported = field_validator(*UNSUPPORTED_SAMPLING_FIELDS)(_refuse_if_set)

    def structured_outputs(self) -> tuple[dict[str, Any] | None, str]:
        """The constraint as vLLM's structured_outputs, and the field it came from."""
        given = {
            "json_schema": ("json", self.json_schema),
            "regex": ("regex", self.regex),
            "ebnf": ("grammar", self.ebnf),
        }
        set_ = {name: pair for name, pair in given.items() if pair[1] is not None}
        if len(set_) > 1:
            raise ValueError(
                f"only one structured output constraint may be set; got {', '.join(set_)}"
            )
        for name, (kind, value) in set_.items():
            return {kind: value}, f"sampling_params.{name}"
        return None, "sampling_params.json_schema"


class SGLangGenerateRequest(RequestModel):
    """One prompt or a batch (``text`` a list of strings, ``input_ids`` a list of id lists)."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    sampling_params: SGLangSamplingParams = Field(default_factory=SGLangSamplingParams)
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0)
    return_text_in_logprobs: bool = False
    # Input logprobs from this prompt position on; -1: output logprobs only (SGLang's default).
    logprob_start_len: Int64 = -1
    rid: str | list[str] | None = None
    stream: bool = False
    # One salt, or one per prompt of a batch (SGLang's).
    cache_salt: CacheSalt | list[CacheSalt] | None = None
    # Each output token's sampling support in ``meta_info`` (SGLang's).
    return_sampling_mask: bool = False
    # Routed experts per token in ``meta_info`` (SGLang's; the server must capture them), from
    # this absolute position on.
    return_routed_experts: bool = False
    routed_experts_start_len: NonNegativeInt64 = 0
    # Refused when set; see UNSUPPORTED_FIELDS.
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    # The loaded LoRA adapter's name (SGLang's), or one per prompt of a batch.
    lora_path: str | list[str | None] | None = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    session_params: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: Any = None

    _unsupported = field_validator(*UNSUPPORTED_FIELDS)(_refuse_if_set)

    @model_validator(mode="after")
    def _prompts(self) -> SGLangGenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("send exactly one of text and input_ids")
        ids = self.input_ids
        rows = ids if ids and all(isinstance(i, list) for i in ids) else [ids or []]
        if ids is not None and not all(
            type(i) is int and 0 <= i <= INT64_MAX for row in rows for i in row
        ):
            raise ValueError("input_ids must be non-negative 64-bit integers, or lists of them")
        if isinstance(self.text, list) and not self.text:
            raise ValueError("a batch needs at least one prompt")
        rids = [self.rid] if isinstance(self.rid, str) else self.rid or []
        if any(len(rid) > 256 for rid in rids):
            raise ValueError("rid must be at most 256 characters")
        if isinstance(self.rid, list) and len(rids) != len(self.prompts):
            raise ValueError("a list of rids needs one per prompt")
        if isinstance(self.cache_salt, list) and len(self.cache_salt) != len(self.prompts):
            raise ValueError("a list of cache_salt needs one per prompt")
        return self

    @property
    def batched(self) -> bool:
        """A list of prompts (answered with a list, as is a prompt with ``n > 1``)."""
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and all(isinstance(i, list) for i in self.input_ids or ())

    @property
    def cache_salts(self) -> list[str | None]:
        """Each prompt's salt."""
        if isinstance(self.cache_salt, list):
            return list(self.cache_salt)
        return [self.cache_salt] * len(self.prompts)

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        if self.text is not None:
            return list(self.text) if isinstance(self.text, list) else [self.text]
        return list(self.input_ids or ()) if self.batched else [list(self.input_ids or ())]
