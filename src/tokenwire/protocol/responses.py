"""The response bodies as the OpenAPI document describes them.

The pipeline builds its answers as plain dicts (orjson writes them; pydantic would cost time on
large logprob payloads), so these models only document the shapes: the routes name them in the
OpenAPI document and the schema fuzz test checks every answer against them. Fields clients read
are typed; open-ended parts (logprobs, tool calls) are left as objects.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from tokenwire.protocol.generate import GenerateRequest

JsonObject = dict[str, Any]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class WeightVersionSpan(BaseModel):
    """Output tokens ``start:end`` were sampled with the weights named ``version``."""

    version: str
    start: int
    end: int


class GenerateChoice(BaseModel):
    index: int
    token_ids: list[int]
    logprobs: JsonObject | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    # output_mode "text": the choice's text (a chunk's: what it adds); "derender": its
    # assistant message (streamed: ``delta``, what the chunk adds to it).
    text: str | None = None
    message: JsonObject | None = None
    delta: JsonObject | None = None
    # With return_sampling_mask: each output token's support ids.
    sampling_mask: list[list[int]] | None = None
    # With --enable-return-routed-experts, on the final output: vLLM's base64 .npy of
    # (num_tokens - 1 - routed_experts_prompt_start, layers, top_k) uint8/uint16 expert ids.
    routed_experts: str | None = None


class GenerateResponse(BaseModel):
    request_id: str
    model: str
    created: int
    usage: Usage
    choices: list[GenerateChoice]
    prompt_logprobs: list[dict[str, JsonObject] | None] | None = None
    # With prompt_logprob_token_ids: float32 [rows, ids] as base64 .npy bytes (vLLM's).
    prompt_token_id_logprobs: str | None = None


class GenerateChunk(BaseModel):
    """One SSE event of a streamed generate: new tokens of one choice, or the usage last."""

    request_id: str
    choices: list[GenerateChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    """What a streamed chunk adds to the assistant message (the role on the first only)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[JsonObject] | None = None


class AssistantMessage(ChatDelta):
    role: Literal["assistant"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: JsonObject | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None  # with return_token_ids
    # With --enable-return-routed-experts: as GenerateChoice's.
    routed_experts: str | None = None


PromptLogprobs = list[dict[str, JsonObject] | None]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    prompt_logprobs: PromptLogprobs | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: JsonObject | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None
    routed_experts: str | None = None  # on a choice's last chunk, as GenerateChoice's


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    # The stream's first chunk, with return_token_ids / prompt_logprobs.
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: JsonObject | None = None
    finish_reason: str | None
    # With return_token_ids / prompt_logprobs (streamed: the prompt's on a choice's first chunk).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # With --enable-return-routed-experts (streamed: on a choice's last chunk): as
    # GenerateChoice's.
    routed_experts: str | None = None


class CompletionResponse(BaseModel):
    """``text_completion``; streamed, each SSE event has this shape (``usage`` on the last)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatDerenderChunk(BaseModel):
    """A streamed derender step: the chunk, and the state to send with the next one."""

    chunk: ChatCompletionChunk
    stream_state: str


class ExtendResponse(GenerateRequest):
    """Render's GenerateRequest for the next turn, and whether it starts with the previous ids."""

    extended: bool
    reason: str | None
    kept_tokens: int


class SGLangMetaInfo(BaseModel):
    id: str
    finish_reason: JsonObject | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str | None = None
    weight_versions: list[WeightVersionSpan] = []
    output_token_logprobs: list[list[Any]] | None = None
    output_top_logprobs: list[list[list[Any]] | None] | None = None
    # With ``logprob_start_len`` >= 0: the prompt's, from there on (the first token's is null).
    input_token_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[list[list[Any]] | None] | None = None
    # With ``return_sampling_mask``: each output token's support ids, the sampled token's
    # logprob over its support, and how many tokens have one.
    output_token_sampling_mask: list[list[int]] | None = None
    output_token_sampling_logprobs: list[float] | None = None
    output_token_sampling_mask_length: int | None = None
    # With ``return_routed_experts``, once finished: base64 of flat int32 expert ids from
    # ``routed_experts_start_len`` on (reshape to (-1, layers, top_k)).
    routed_experts: str | None = None
    routed_experts_start_len: int | None = None


class SGLangGenerateResponse(BaseModel):
    """SGLang's ``/generate``; streamed, each SSE event has this shape, cumulatively."""

    text: str
    output_ids: list[int]
    meta_info: SGLangMetaInfo
    index: int | None = None  # streamed batches: which prompt's choice this event is


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class VersionResponse(BaseModel):
    version: str


class ModelInfo(BaseModel):
    model_path: str
    tokenizer_path: str
    is_generation: bool
    served_model_name: str
    weight_version: str
    max_model_len: int


class GetLoadResponse(BaseModel):
    load: int


class ServerLoadResponse(BaseModel):
    server_load: int


class AbortResponse(BaseModel):
    status: Literal["aborted"]
    aborted: int


class StatusResponse(BaseModel):
    """``{"status": "paused"}`` and the like."""

    status: str


class MessageStatusResponse(BaseModel):
    message: str
    status: str


class VLLMServerGenerateResponse(BaseModel):
    """vLLM's old demo server's ``/generate`` answer (atropos' ``VLLMServer`` reads it): per
    choice its text and finish reason; with ``logprobs``, per choice per token a one-item
    list ``[{token_id: logprob, ...}]`` (the sampled token first), and the ids."""

    text: list[str]
    prompt: str
    finish_reasons: list[str | None]
    logprobs: list[list[list[dict[str, float | str]]]] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[list[int]] | None = None
    prompt_logprobs: list[dict[str, float | str] | None] | None = None


class CollectiveRpcResponse(BaseModel):
    """vLLM's ``/collective_rpc`` answer: one result per worker (this server is one)."""

    results: list[Any]


class IsPausedResponse(BaseModel):
    is_paused: bool


class IsSleepingResponse(BaseModel):
    is_sleeping: bool


class SuccessResponse(BaseModel):
    success: bool


class ServerInfoResponse(BaseModel):
    """vLLM's ``/server_info``: ``vllm_config`` is an object with ``config_format=json``."""

    vllm_config: JsonObject | str
    vllm_env: JsonObject
    system_env: JsonObject


class WorldSizeResponse(BaseModel):
    world_size: int


class WeightInfoResponse(BaseModel):
    weight_version: str
    # tokenwire's: the weight lifecycle's state, and why the weights are broken (else null).
    state: Literal["whole", "updating", "broken"]
    reason: str | None


class UpdateWeightVersionResponse(BaseModel):
    success: bool
    new_version: str
    message: str


class UpdateWeightsResponse(BaseModel):
    """prime-rl's answer (``weight_dir``); vLLM's form is answered with a ``MessageResponse``."""

    success: bool
    weight_version: str


class MessageResponse(BaseModel):
    """vLLM's weight-transfer answers: ``{"message": "Weights updated"}`` and the like."""

    message: str


class SuccessMessageResponse(BaseModel):
    """SGLang's weight-update answers."""

    success: bool
    message: str


class UpdateWeightsFromDiskResponse(BaseModel):
    success: bool
    message: str
    num_paused_requests: int


class SGLangLoraResponse(BaseModel):
    """SGLang's answer to ``/load_lora_adapter`` and ``/unload_lora_adapter``."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str]
