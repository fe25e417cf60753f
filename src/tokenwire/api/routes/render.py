"""POST /v1/chat/completions/render and /v1/completions/render: requests -> GenerateRequests.

Chat render and /tokenize (chat form) both go through ``render_chat``, so they cannot disagree.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenwire.api.errors import bad_request
from tokenwire.api.generation import check_prompt
from tokenwire.api.offload import run_text_work
from tokenwire.api.rendering import render_chat_media
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.state import ModelRuntime, serving
from tokenwire.protocol.generate import SamplingParamsModel
from tokenwire.protocol.openai import ChatCompletionRequest, CompletionRequest, SamplingFields

router = APIRouter(tags=["render"])


def generate_request_json(
    request_id: str,
    token_ids: list[int],
    sampling: SamplingParamsModel,
    body: SamplingFields,
    model: str,
    features: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "features": features,
        "sampling_params": sampling.model_dump(exclude_none=True, exclude_defaults=False),
        "model": model,
        "stream": body.stream,
        "stream_options": body.stream_options.model_dump() if body.stream_options else None,
        "cache_salt": body.cache_salt,
        "priority": body.priority,
    }


def request_sampling(
    runtime: ModelRuntime,
    body: SamplingFields,
    token_ids: list[int],
    *,
    max_tokens: int | None,
    logprobs: int | None,
    param: str,
) -> SamplingParamsModel:
    """The generate sampling_params of a chat or completion request for this prompt."""
    max_tokens = check_prompt(runtime, token_ids, max_tokens, param=param)
    try:
        return body.sampling_params(max_tokens=max_tokens, logprobs=logprobs)
    except ValueError as exc:
        raise bad_request(str(exc)) from exc


def chat_sampling(
    runtime: ModelRuntime, body: ChatCompletionRequest, token_ids: list[int]
) -> SamplingParamsModel:
    return request_sampling(
        runtime,
        body,
        token_ids,
        max_tokens=body.requested_max_tokens,
        logprobs=body.num_logprobs,
        param="messages",
    )


def completion_sampling(
    runtime: ModelRuntime, body: CompletionRequest, token_ids: list[int]
) -> SamplingParamsModel:
    return request_sampling(
        runtime, body, token_ids, max_tokens=body.max_tokens, logprobs=body.logprobs, param="prompt"
    )


@router.post("/v1/chat/completions/render")
async def render_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
) -> Response:
    state, runtime = serving(request)
    state.check_model(body.model)
    rendered = await render_chat_media(
        state, runtime, body, add_special_tokens=body.add_special_tokens
    )
    sampling = chat_sampling(runtime, body, rendered.token_ids)
    request_id = body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    features = None
    if rendered.media is not None:
        # Serialising pixel tensors is CPU work of milliseconds: off the event loop.
        features = await asyncio.to_thread(runtime.media.features_json, rendered.media)
    return OrjsonResponse(
        generate_request_json(
            request_id, rendered.token_ids, sampling, body, state.served_name, features
        )
    )


def completion_prompt_ids(runtime: ModelRuntime, body: CompletionRequest) -> list[list[int]]:
    tokenizer = runtime.tokenizer
    return [
        tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens)
        if isinstance(prompt, str)
        else prompt
        for prompt in body.prompts
    ]


@router.post("/v1/completions/render")
async def render_completion(
    body: CompletionRequest,
    request: Request,
) -> Response:
    state, runtime = serving(request)
    state.check_model(body.model)
    size = sum(len(p) for p in body.prompts)
    prompts = await run_text_work(size, lambda: completion_prompt_ids(runtime, body))
    base_id = body.request_id or f"cmpl-{uuid.uuid4().hex}"
    requests = []
    for index, token_ids in enumerate(prompts):
        if not token_ids:
            raise bad_request(f"prompt {index} is empty after tokenization", "prompt")
        sampling = completion_sampling(runtime, body, token_ids)
        request_id = base_id if len(prompts) == 1 else f"{base_id}-{index}"
        requests.append(
            generate_request_json(request_id, token_ids, sampling, body, state.served_name)
        )
    return OrjsonResponse(requests)
