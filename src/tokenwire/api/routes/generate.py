"""POST /inference/v1/generate and POST /abort_requests: token ids in, token ids out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field
from starlette.responses import Response, StreamingResponse

from tokenwire.api.disconnect import unless_disconnected
from tokenwire.api.errors import bad_request
from tokenwire.api.generation import ChoiceResult, GenerationJob, check_prompt
from tokenwire.api.logprobs_format import prompt_logprobs_json, token_logprobs_json
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.state import ModelRuntime, ServerState, serving
from tokenwire.api.streams import sse_frames, usage_json
from tokenwire.engine.base import MultiModalInput
from tokenwire.protocol.common import RequestModel
from tokenwire.protocol.generate import GenerateRequest

router = APIRouter(tags=["generate"])


class AbortRequest(RequestModel):
    request_ids: list[str] = Field(min_length=1)


def start_job(
    state: ServerState,
    runtime: ModelRuntime,
    request_id: str,
    prompt_ids: list[int],
    body_params: Any,
    media: Any = None,
) -> GenerationJob:
    """Validate against the model and register the job so /abort_requests can find it."""
    if body_params.n > state.settings.max_n:
        raise bad_request(f"n must be at most {state.settings.max_n}, got {body_params.n}", "n")
    if request_id in state.jobs:
        raise bad_request(f"request id {request_id!r} is already running", "request_id")
    max_tokens = check_prompt(runtime, prompt_ids, body_params.max_tokens, param="token_ids")
    job = GenerationJob(
        runtime, request_id, prompt_ids, body_params, max_tokens=max_tokens, media=media
    )
    state.jobs[request_id] = job
    return job


@router.post("/inference/v1/generate")
async def generate(
    body: GenerateRequest,
    request: Request,
) -> Response:
    state, runtime = serving(request)
    state.check_model(body.model)
    request_id = request.headers.get("x-request-id") or body.request_id
    prompt_ids, media = await _prompt_media(runtime, body)
    job = start_job(state, runtime, request_id, prompt_ids, body.sampling_params, media)
    if body.stream:
        return StreamingResponse(
            _stream(state, job, body),
            media_type="text/event-stream",
            headers={"X-Request-Id": request_id},
        )
    try:
        results = await unless_disconnected(request, job.collect())
    finally:
        state.jobs.pop(request_id, None)
    num_top = body.sampling_params.num_logprobs or 0
    completion_tokens = sum(len(r.token_ids) for r in results)
    return OrjsonResponse(
        {
            "request_id": request_id,
            "model": state.served_name,
            "created": int(time.time()),
            "usage": usage_json(len(prompt_ids), completion_tokens),
            "choices": [_choice_json(result, num_top) for result in results],
            "prompt_logprobs": prompt_logprobs_json(prompt_ids, job.prompt_logprobs),
        },
        headers={"X-Request-Id": request_id},
    )


@router.post("/abort_requests")
async def abort_requests(
    body: AbortRequest,
    request: Request,
) -> Response:
    state, _ = serving(request)
    aborted = []
    for request_id in body.request_ids:
        job = state.jobs.get(request_id)
        if job is not None:
            await job.abort()
            aborted.append(request_id)
    return OrjsonResponse({"aborted": aborted})


async def _prompt_media(
    runtime: ModelRuntime, body: GenerateRequest
) -> tuple[list[int], MultiModalInput | None]:
    """The ids the engine runs and their media, from ``content_parts`` or ``features``.

    ``content_parts``: one ``<|image_pad|>`` per image, expanded here to the image's token count
    (ids whose pad runs already have those lengths, as render returns them, are used as sent).
    ``features``: ids as render returned them; the ranges are checked against the ids.
    """
    if body.content_parts is not None:
        prompt = await runtime.media.prompt_from_content_parts(body.token_ids, body.content_parts)
    elif body.features is not None:
        prompt = await runtime.media.prompt_from_features(body.token_ids, body.features)
    else:
        return body.token_ids, None
    return prompt.token_ids, prompt.engine_input() if prompt.items else None


def _choice_json(result: ChoiceResult, num_top: int) -> dict[str, Any]:
    return {
        "index": result.index,
        "token_ids": result.token_ids,
        "logprobs": None
        if result.logprobs is None
        else token_logprobs_json(result.logprobs, num_top),
        "finish_reason": result.finish_reason,
    }


async def _stream(
    state: ServerState, job: GenerationJob, body: GenerateRequest
) -> AsyncIterator[bytes]:
    """SSE chunks; a disconnect cancels this generator, which aborts the job's engine requests."""
    try:
        async for frame in sse_frames(_chunks(job, body)):
            yield frame
    finally:
        state.jobs.pop(job.request_id, None)


async def _chunks(job: GenerationJob, body: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
    options = body.stream_options
    include_usage = options is not None and options.include_usage
    continuous = options is not None and options.continuous_usage_stats
    num_top = body.sampling_params.num_logprobs or 0
    wants_logprobs = body.sampling_params.num_logprobs is not None
    prompt_tokens = len(job.prompt_ids)
    completion_tokens = 0
    async for delta in job.deltas():
        output = delta.output
        completion_tokens += len(output.new_token_ids)
        chunk: dict[str, Any] = {
            "request_id": job.request_id,
            "choices": [
                {
                    "index": delta.index,
                    "token_ids": output.new_token_ids,
                    "logprobs": token_logprobs_json(output.logprobs or [], num_top)
                    if wants_logprobs
                    else None,
                    "finish_reason": output.finish_reason,
                }
            ],
        }
        if output.prompt_logprobs is not None:
            chunk["prompt_logprobs"] = prompt_logprobs_json(job.prompt_ids, output.prompt_logprobs)
        if continuous:
            chunk["usage"] = usage_json(prompt_tokens, completion_tokens)
        yield chunk
    if include_usage:
        yield {
            "request_id": job.request_id,
            "choices": [],
            "usage": usage_json(prompt_tokens, completion_tokens),
        }
