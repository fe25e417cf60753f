"""OpenAI-compatible POST /v1/chat/completions and /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenwire.api.admission import admitted
from tokenwire.api.disconnect import unless_disconnected
from tokenwire.api.openapi import MEDIA_ERRORS, streamed
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.sse import sse_response
from tokenwire.api.state import pipeline_of, session_header
from tokenwire.pipeline.logprob_limit import apply_logprob_limit
from tokenwire.pipeline.openai import CompletionRun, start_chat_completion, start_completion
from tokenwire.protocol.openai import ChatCompletionRequest, CompletionRequest
from tokenwire.protocol.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
)

router = APIRouter(tags=["openai"])


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={**streamed(ChatCompletionChunk), **MEDIA_ERRORS},
)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    pipeline = pipeline_of(request)
    apply_logprob_limit(pipeline, body)
    run = await admitted(
        request, pipeline, start_chat_completion(pipeline, body, session=session_header(request))
    )
    return await _respond(run, request, stream=body.stream)


@router.post(
    "/v1/completions", response_model=CompletionResponse, responses=streamed(CompletionResponse)
)
async def completions(body: CompletionRequest, request: Request) -> Response:
    pipeline = pipeline_of(request)
    apply_logprob_limit(pipeline, body)
    run = await admitted(request, pipeline, start_completion(pipeline, body))
    return await _respond(run, request, stream=body.stream)


async def _respond(run: CompletionRun, request: Request, *, stream: bool) -> Response:
    if stream:
        return sse_response(run.chunks())
    body = await unless_disconnected(request, run.response())
    return OrjsonResponse(body, headers=run.session_headers())
