"""Render: chat and completion requests -> the GenerateRequests that /inference/v1/generate takes.

The OpenAI routes start from the same prompts and sampling params, so a chat completion and
render -> generate -> derender made one by one give identical tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from tokenwire.engine.base import MultiModalInput
from tokenwire.ids import random_hex
from tokenwire.media.refs import chat_media_refs
from tokenwire.pipeline.chat_render import RenderedChat, render_chat
from tokenwire.pipeline.context import ModelRuntime, Pipeline
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.pipeline.offload import run_text_work
from tokenwire.pipeline.prompt_memory import ids_json
from tokenwire.pipeline.session_store import Owner
from tokenwire.pipeline.validation import ValidPrompt, request_prompt, request_sampling
from tokenwire.protocol.generate import SamplingParamsModel
from tokenwire.protocol.openai import ChatCompletionRequest, CompletionRequest, SamplingFields


@dataclass(slots=True)
class ChatPrompt:
    """A chat request rendered and checked, ready to generate from."""

    request_id: str
    rendered: RenderedChat | None  # None: the ids were extended, not rendered (sessions)
    prompt: ValidPrompt


async def chat_prompt(
    pipeline: Pipeline, runtime: ModelRuntime, body: ChatCompletionRequest, *, record: bool = False
) -> ChatPrompt:
    rendered = await render_chat(
        pipeline, runtime, body, add_special_tokens=body.add_special_tokens
    )
    media = rendered.media
    prompt = chat_request_prompt(
        pipeline,
        runtime,
        body,
        rendered.token_ids,
        param="messages",
        media=media.engine_input() if media is not None else None,
        record=record,
    )
    return ChatPrompt(chat_request_id(body), rendered, prompt)


def chat_request_prompt(
    pipeline: Pipeline,
    runtime: ModelRuntime,
    body: ChatCompletionRequest,
    token_ids: list[int],
    *,
    param: str,
    media: MultiModalInput | None = None,
    record: bool = False,
    checked: int = 0,
) -> ValidPrompt:
    """A chat request's prompt ``token_ids`` with its sampling params, checked (but for the
    ``checked`` leading ids, checked before). ``record``: the engine reports the sampled tokens'
    logprobs even when the answer shows none (a session records them)."""
    logprobs = body.num_logprobs
    return request_prompt(
        pipeline.config,
        runtime,
        body,
        token_ids,
        max_tokens=body.requested_max_tokens,
        logprobs=logprobs if logprobs is not None or not record else 0,
        param=param,
        media=media,
        checked=checked,
    )


def chat_request_sampling(
    pipeline: Pipeline,
    runtime: ModelRuntime,
    body: ChatCompletionRequest,
    token_ids: Sequence[int],
    *,
    param: str,
    checked: int = 0,
) -> SamplingParamsModel:
    """``chat_request_prompt``'s sampling params, for an answer that sends the ids (which may
    be a remembered prompt's, chained) rather than run them."""
    return request_sampling(
        pipeline.config,
        runtime,
        body,
        token_ids,
        max_tokens=body.requested_max_tokens,
        logprobs=body.num_logprobs,
        param=param,
        checked=checked,
    )


def chat_request_id(body: ChatCompletionRequest) -> str:
    return body.request_id or f"chatcmpl-{random_hex()}"


def completion_request_id(body: CompletionRequest) -> str:
    return body.request_id or f"cmpl-{random_hex()}"


async def completion_prompts(
    pipeline: Pipeline, runtime: ModelRuntime, body: CompletionRequest
) -> list[ValidPrompt]:
    """One checked prompt per entry of ``prompt``."""
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
    prompts = []
    for index, token_ids in enumerate(all_ids):
        if not token_ids:
            raise InvalidRequest(f"prompt {index} is empty after tokenization", "prompt")
        prompts.append(
            request_prompt(
                pipeline.config,
                runtime,
                body,
                token_ids,
                max_tokens=body.max_tokens,
                logprobs=body.logprobs,
                param="prompt",
            )
        )
    return prompts


async def render_chat_request(
    pipeline: Pipeline, body: ChatCompletionRequest, *, remember_for: Owner | None = None
) -> dict[str, Any]:
    """/v1/chat/completions/render: one GenerateRequest, with the images' features; with
    ``remember_for``, the prompt is remembered for that owner and its ``prompt_handle`` added."""
    runtime = pipeline.ready(body.model)
    if remember_for is not None and chat_media_refs(body.messages):
        raise InvalidRequest(
            "return_prompt_handle is for text conversations (extend takes no media)",
            "return_prompt_handle",
        )
    prompt = await chat_prompt(pipeline, runtime, body)
    rendered = prompt.rendered
    assert rendered is not None  # rendered, not extended
    features = None
    if rendered.media is not None:
        # Serialising pixel tensors is CPU work of milliseconds: off the event loop.
        features = await asyncio.to_thread(runtime.media.features_json, rendered.media)
    response = generate_request_json(
        pipeline, prompt.request_id, prompt.prompt.token_ids, prompt.prompt.sampling, body, features
    )
    if remember_for is not None:
        # Encoded once: the answer sends what the memory keeps for the next turn's answer.
        token_ids_json = ids_json(rendered.token_ids)
        response["token_ids"] = orjson.Fragment(token_ids_json.array())
        response["prompt_handle"] = pipeline.prompt_memory.remember_render(
            body, rendered.token_ids, body.messages, rendered.text, remember_for, token_ids_json
        )
    return response


async def render_completion_request(
    pipeline: Pipeline, body: CompletionRequest
) -> list[dict[str, Any]]:
    """/v1/completions/render: one GenerateRequest per prompt."""
    runtime = pipeline.ready(body.model)
    prompts = await completion_prompts(pipeline, runtime, body)
    # One GenerateRequest per prompt; ids ``<base>-<i>`` when there are several.
    base_id = completion_request_id(body)
    return [
        generate_request_json(
            pipeline,
            base_id if len(prompts) == 1 else f"{base_id}-{i}",
            prompt.token_ids,
            prompt.sampling,
            body,
        )
        for i, prompt in enumerate(prompts)
    ]


def generate_request_json(
    pipeline: Pipeline,
    request_id: str,
    token_ids: list[int] | orjson.Fragment,
    sampling: SamplingParamsModel,
    body: SamplingFields,
    features: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A GenerateRequest for ``token_ids`` (their JSON, where a caller has it)."""
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
