"""OpenAI-compatible POST /v1/chat/completions and /v1/completions.

Each is render -> generate -> derender through the same functions the token-level endpoints
use, so a chat completion and the three calls made one by one give identical tokens and text.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from tokenwire.api.derendering import (
    PLAIN,
    assistant_message,
    chat_finish_reason,
    chat_logprobs_fragment,
    chat_parsing,
    completion_logprobs,
    text_ids,
)
from tokenwire.api.disconnect import unless_disconnected
from tokenwire.api.errors import APIError
from tokenwire.api.generation import ChoiceDelta, ChoiceResult, GenerationJob
from tokenwire.api.offload import run_text_work
from tokenwire.api.rendering import render_chat_media
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.routes.generate import start_job
from tokenwire.api.routes.render import (
    chat_sampling,
    completion_prompt_ids,
    completion_sampling,
)
from tokenwire.api.state import ModelRuntime, ServerState, serving
from tokenwire.api.streaming_derender import ChoiceStream
from tokenwire.api.streams import merge, sse_frames, usage_json
from tokenwire.engine.base import TokenLogprob
from tokenwire.protocol.openai import ChatCompletionRequest, CompletionRequest
from tokenwire.text.token_text import LogprobInput

router = APIRouter(tags=["openai"])


def engine_logprobs(entries: list[TokenLogprob], num_top: int) -> LogprobInput:
    """OpenAI's top_logprobs are the k most likely tokens (the sampled one may be absent)."""
    return LogprobInput(
        token_ids=[entry.token_id for entry in entries],
        logprobs=[entry.logprob for entry in entries],
        top_ids=[[token_id for token_id, _ in entry.top[:num_top]] for entry in entries],
        top_logprobs=[[logprob for _, logprob in entry.top[:num_top]] for entry in entries],
    )


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state, runtime = serving(request)
    state.check_model(body.model)
    rendered = await render_chat_media(
        state, runtime, body, add_special_tokens=body.add_special_tokens
    )
    prompt_ids = rendered.token_ids
    sampling = chat_sampling(runtime, body, prompt_ids)
    request_id = body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    parsing = chat_parsing(state, runtime, body, prompt_ids)
    media = rendered.media.engine_input() if rendered.media is not None else None
    job = start_job(state, runtime, request_id, prompt_ids, sampling, media)
    created = int(time.time())
    stop_ids = set(body.stop_token_ids or ())
    if body.stream:
        streams = [
            ChoiceStream.start(runtime, parsing, prompt_ids, stop_ids) for _ in range(sampling.n)
        ]

        def chunk_choice(delta: ChoiceDelta) -> dict[str, Any]:
            output = delta.output
            logprobs = None
            if body.num_logprobs is not None:
                logprobs = engine_logprobs(output.logprobs or [], body.num_logprobs)
            return streams[delta.index].step(
                delta.index, output.new_token_ids, logprobs, output.finish_reason
            )

        return _sse_many(
            state,
            [job],
            body,
            lambda _, delta: chunk_choice(delta),
            created,
            len(prompt_ids),
            kind="chat.completion.chunk",
        )
    try:
        results = await unless_disconnected(request, job.collect())
    finally:
        state.jobs.pop(request_id, None)
    choices = []
    for result in results:
        visible = text_ids(runtime, result.token_ids, result.finish_reason, list(stop_ids))
        message = assistant_message(runtime, visible, parsing)
        logprobs = None
        if body.num_logprobs is not None and result.logprobs is not None:
            columns = engine_logprobs(result.logprobs, body.num_logprobs)
            logprobs = chat_logprobs_fragment(runtime, result.token_ids, columns, prompt_ids)
        choices.append(
            {
                "index": result.index,
                "message": message.to_json(),
                "logprobs": logprobs,
                "finish_reason": chat_finish_reason(result.finish_reason, message, parsing),
            }
        )
    return OrjsonResponse(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": state.served_name,
            "choices": choices,
            "usage": usage_json(len(prompt_ids), sum(len(r.token_ids) for r in results)),
        }
    )


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state, runtime = serving(request)
    state.check_model(body.model)
    size = sum(len(p) for p in body.prompts)
    prompts = await run_text_work(size, lambda: completion_prompt_ids(runtime, body))
    base_id = body.request_id or f"cmpl-{uuid.uuid4().hex}"
    jobs = []
    try:
        for index, prompt_ids in enumerate(prompts):
            sampling = completion_sampling(runtime, body, prompt_ids)
            job_id = base_id if len(prompts) == 1 else f"{base_id}-{index}"
            jobs.append(start_job(state, runtime, job_id, prompt_ids, sampling))
    except APIError:
        for job in jobs:
            state.jobs.pop(job.request_id, None)
        raise
    created = int(time.time())
    stop_ids = list(body.stop_token_ids or ())
    n = body.n
    prompt_tokens = sum(len(p) for p in prompts)
    if body.stream:
        streams = {}

        def chunk_choice(job_index: int, delta: ChoiceDelta) -> dict[str, Any]:
            index = job_index * n + delta.index
            if index not in streams:
                streams[index] = ChoiceStream.start(
                    runtime,
                    PLAIN,
                    jobs[job_index].prompt_ids,
                    set(stop_ids),
                )
            output = delta.output
            logprobs = None
            if body.logprobs is not None:
                logprobs = engine_logprobs(output.logprobs or [], body.logprobs)
            step = streams[index].step(index, output.new_token_ids, None, output.finish_reason)
            choice: dict[str, Any] = {
                "index": index,
                "text": step["delta"].get("content") or "",
                "logprobs": None,
                "finish_reason": step["finish_reason"],
            }
            if logprobs is not None:
                choice["logprobs"] = completion_logprobs(
                    runtime, output.new_token_ids, logprobs, jobs[job_index].prompt_ids
                )
            return choice

        return _sse_many(state, jobs, body, chunk_choice, created, prompt_tokens)
    try:
        per_job = await unless_disconnected(
            request, asyncio.gather(*(job.collect() for job in jobs))
        )
    finally:
        for job in jobs:
            state.jobs.pop(job.request_id, None)
    choices = []
    completion_tokens = 0
    for job, results in zip(jobs, per_job, strict=True):
        for result in results:
            completion_tokens += len(result.token_ids)
            choices.append(_completion_choice(runtime, job, result, body, len(choices), stop_ids))
    return OrjsonResponse(
        {
            "id": base_id,
            "object": "text_completion",
            "created": created,
            "model": state.served_name,
            "choices": choices,
            "usage": usage_json(prompt_tokens, completion_tokens),
        }
    )


def _completion_choice(
    runtime: ModelRuntime,
    job: GenerationJob,
    result: ChoiceResult,
    body: CompletionRequest,
    index: int,
    stop_ids: list[int],
) -> dict[str, Any]:
    visible = text_ids(runtime, result.token_ids, result.finish_reason, stop_ids)
    logprobs = None
    if body.logprobs is not None and result.logprobs is not None:
        columns = engine_logprobs(result.logprobs, body.logprobs)
        logprobs = completion_logprobs(runtime, result.token_ids, columns, job.prompt_ids)
    return {
        "index": index,
        "text": runtime.tokenizer.decode(visible, skip_special_tokens=body.skip_special_tokens),
        "logprobs": logprobs,
        "finish_reason": result.finish_reason,
    }


def _sse_many(
    state: ServerState,
    jobs: list[GenerationJob],
    body: ChatCompletionRequest | CompletionRequest,
    chunk_choice: Any,
    created: int,
    prompt_tokens: int,
    kind: str = "text_completion",
) -> StreamingResponse:
    """OpenAI SSE: one chunk per choice delta, an optional usage chunk, then [DONE]."""
    stream_id = jobs[0].request_id if len(jobs) == 1 else jobs[0].request_id.rsplit("-", 1)[0]
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    header = {"id": stream_id, "object": kind, "created": created, "model": state.served_name}

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        completion_tokens = 0
        async for job_index, delta in merge([job.deltas() for job in jobs]):
            completion_tokens += len(delta.output.new_token_ids)
            yield {**header, "choices": [chunk_choice(job_index, delta)]}
        if include_usage:
            yield {**header, "choices": [], "usage": usage_json(prompt_tokens, completion_tokens)}

    async def events() -> AsyncIterator[bytes]:
        try:
            async for frame in sse_frames(chunks()):
                yield frame
        finally:
            for job in jobs:
                state.jobs.pop(job.request_id, None)

    return StreamingResponse(events(), media_type="text/event-stream")
