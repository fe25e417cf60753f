"""POST /v1/chat/completions/derender and /v1/completions/derender: output ids -> responses."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenwire.api.control_key import STATELESS
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.state import pipeline_of
from tokenwire.pipeline import derender as derendering
from tokenwire.pipeline.stream_derender import derender_chat_chunk
from tokenwire.protocol.derender import (
    ChatDerenderBody,
    ChatDerenderStreamRequest,
    CompletionDerenderRequest,
)
from tokenwire.protocol.responses import (
    ChatCompletionResponse,
    ChatDerenderChunk,
    CompletionResponse,
)

router = APIRouter(tags=["derender", STATELESS])


@router.post(
    "/v1/chat/completions/derender",
    response_model=ChatCompletionResponse | ChatDerenderChunk,
)
async def derender_chat(body: ChatDerenderBody, request: Request) -> Response:
    pipeline = pipeline_of(request)
    if isinstance(body, ChatDerenderStreamRequest):
        return OrjsonResponse(await derender_chat_chunk(pipeline, body))
    return OrjsonResponse(await derendering.derender_chat(pipeline, body))


@router.post("/v1/completions/derender", response_model=CompletionResponse)
async def derender_completion(body: CompletionDerenderRequest, request: Request) -> Response:
    return OrjsonResponse(await derendering.derender_completion(pipeline_of(request), body))
