"""OpenAI Responses: POST /v1/responses and /v1/responses/render."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenwire.api.admission import admitted
from tokenwire.api.control_key import STATELESS
from tokenwire.api.disconnect import unless_disconnected
from tokenwire.api.openapi import MEDIA_ERRORS, streamed
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.sse import sse_response
from tokenwire.api.state import pipeline_of, session_header
from tokenwire.pipeline import responses_api
from tokenwire.pipeline.openai import start_chat_completion
from tokenwire.protocol.generate import GenerateRequest
from tokenwire.protocol.openai_responses import (
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)

router = APIRouter(tags=["responses"])


@router.post(
    "/v1/responses",
    response_model=ResponseObject,
    responses={**streamed(ResponseStreamEvent), **MEDIA_ERRORS},
)
async def responses(body: ResponsesRequest, request: Request) -> Response:
    pipeline = pipeline_of(request)
    chat = responses_api.chat_request(body, request_id=responses_api.new_response_id())
    await admitted(request, pipeline)
    started = await start_chat_completion(
        pipeline, chat, session=session_header(request), dialect="responses"
    )
    run = responses_api.ResponseRun(started, body)
    if body.stream:
        return sse_response(run.events(), named=True)
    response = await unless_disconnected(request, run.response())
    return OrjsonResponse(response, headers=started.session_headers())


@router.post(
    "/v1/responses/render", response_model=GenerateRequest, responses=MEDIA_ERRORS, tags=[STATELESS]
)
async def render_response(body: ResponsesRequest, request: Request) -> Response:
    return OrjsonResponse(await responses_api.render_response(pipeline_of(request), body))
