"""POST /v1/chat/completions/render and /v1/completions/render: requests -> GenerateRequests."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenwire.api.control_key import STATELESS
from tokenwire.api.openapi import MEDIA_ERRORS
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.state import owner_of, pipeline_of
from tokenwire.pipeline import render as rendering
from tokenwire.protocol.extend import ChatRenderRequest
from tokenwire.protocol.generate import GenerateRequest
from tokenwire.protocol.openai import CompletionRequest

router = APIRouter(tags=["render", STATELESS])


@router.post("/v1/chat/completions/render", response_model=GenerateRequest, responses=MEDIA_ERRORS)
async def render_chat_completion(body: ChatRenderRequest, request: Request) -> Response:
    owner = owner_of(request) if body.return_prompt_handle else None
    answer = await rendering.render_chat_request(pipeline_of(request), body, remember_for=owner)
    return OrjsonResponse(answer)


@router.post("/v1/completions/render", response_model=list[GenerateRequest])
async def render_completion(body: CompletionRequest, request: Request) -> Response:
    return OrjsonResponse(await rendering.render_completion_request(pipeline_of(request), body))
