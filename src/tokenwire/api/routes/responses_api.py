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
from tokenwire.pipeline.sessions import continued_head
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
    session = session_header(request)
    continued = None
    if body.previous_response_id is not None:
        continued = await continued_head(
            pipeline, session, "previous_response_id", body.previous_response_id
        )
    history = continued.messages if continued is not None else None
    response_id = responses_api.new_response_id()
    chat = responses_api.chat_request(body, request_id=response_id, history=history)
    started = await admitted(
        request,
        pipeline,
        start_chat_completion(
            pipeline, chat, session=session, dialect="responses", continued=continued
        ),
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
