"""Render: chat and completion requests -> the GenerateRequests that /inference/v1/generate takes.

The OpenAI routes start from the same prompts and sampling params, so a chat completion and
render -> generate -> derender made one by one give identical tokens.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

from tokenwire.pipeline.chat_render import RenderedChat, render_chat
from tokenwire.pipeline.context import ModelRuntime, Pipeline
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.pipeline.offload import run_text_work
from tokenwire.pipeline.validation import check_n, request_sampling
from tokenwire.protocol.generate import SamplingParamsModel
from tokenwire.protocol.openai import ChatCompletionRequest, CompletionRequest, SamplingFields


@dataclass(slots=True)
class ChatPrompt:
    """A chat request rendered and checked, ready to generate from."""

    request_id: str
    rendered: RenderedChat
    sampling: SamplingParamsModel


@dataclass(slots=True)
class CompletionPrompt:
    request_id: str
    token_ids: list[int]
    sampling: SamplingParamsModel


async def chat_prompt(
    pipeline: Pipeline, runtime: ModelRuntime, body: ChatCompletionRequest
) -> ChatPrompt:
    rendered = await render_chat(
        pipeline, runtime, body, add_special_tokens=body.add_special_tokens
    )
    sampling = chat_sampling(pipeline, runtime, body, rendered.token_ids, param="messages")
    return ChatPrompt(chat_request_id(body), rendered, sampling)


def chat_sampling(
    pipeline: Pipeline,
    runtime: ModelRuntime,
    body: ChatCompletionRequest,
    token_ids: list[int],
    *,
    param: str,
) -> SamplingParamsModel:
    """A chat request's sampling params for the prompt ``token_ids`` (checked against it)."""
    sampling = request_sampling(
        runtime,
        body,
        token_ids,
        max_tokens=body.requested_max_tokens,
        logprobs=body.num_logprobs,
        param=param,
    )
    check_n(pipeline.config, sampling.n)
    return sampling


def chat_request_id(body: ChatCompletionRequest) -> str:
    return body.request_id or f"chatcmpl-{uuid.uuid4().hex}"


async def completion_prompts(
    pipeline: Pipeline, runtime: ModelRuntime, body: CompletionRequest
) -> list[CompletionPrompt]:
    """One prompt per entry of ``prompt``; ids ``<base>-<i>`` when there are several."""
    tokenizer = runtime.tokenizer
    add_special = body.add_special_tokens

    def encode() -> list[list[int]]:
        return [
            tokenizer.encode(prompt, add_special_tokens=add_special)
            if isinstance(prompt, str)
            else prompt
            for prompt in body.prompts
        ]

    all_ids = await run_text_work(sum(len(p) for p in body.prompts), encode)
    base_id = body.request_id or f"cmpl-{uuid.uuid4().hex}"
    prompts = []
    for index, token_ids in enumerate(all_ids):
        if not token_ids:
            raise InvalidRequest(f"prompt {index} is empty after tokenization", "prompt")
        sampling = request_sampling(
            runtime,
            body,
            token_ids,
            max_tokens=body.max_tokens,
            logprobs=body.logprobs,
            param="prompt",
        )
        check_n(pipeline.config, sampling.n)
        request_id = base_id if len(all_ids) == 1 else f"{base_id}-{index}"
        prompts.append(CompletionPrompt(request_id, token_ids, sampling))
    return prompts


async def render_chat_request(pipeline: Pipeline, body: ChatCompletionRequest) -> dict[str, Any]:
    """/v1/chat/completions/render: one GenerateRequest, with the images' features."""
    runtime = pipeline.ready(body.model)
    prompt = await chat_prompt(pipeline, runtime, body)
    media = prompt.rendered.media
    features = None
    if media is not None:
        # Serialising pixel tensors is CPU work of milliseconds: off the event loop.
        features = await asyncio.to_thread(runtime.media.features_json, media)
    return generate_request_json(
        pipeline,
        prompt.request_id,
        prompt.rendered.token_ids,
        prompt.sampling,
        body,
        features,
    )


async def render_completion_request(
    pipeline: Pipeline, body: CompletionRequest
) -> list[dict[str, Any]]:
    """/v1/completions/render: one GenerateRequest per prompt."""
    runtime = pipeline.ready(body.model)
    prompts = await completion_prompts(pipeline, runtime, body)
    return [
        generate_request_json(pipeline, p.request_id, p.token_ids, p.sampling, body)
        for p in prompts
    ]


def generate_request_json(
    pipeline: Pipeline,
    request_id: str,
    token_ids: list[int],
    sampling: SamplingParamsModel,
    body: SamplingFields,
    features: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "features": features,
        "sampling_params": sampling.model_dump(exclude_none=True, exclude_defaults=False),
        "model": pipeline.config.served_name,
        "stream": body.stream,
        "stream_options": body.stream_options.model_dump() if body.stream_options else None,
        "cache_salt": body.cache_salt,
        "priority": body.priority,
    }
