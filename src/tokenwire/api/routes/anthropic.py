"""Anthropic Messages: POST /v1/messages, /v1/messages/count_tokens and /v1/messages/render."""

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
from tokenwire.pipeline import anthropic
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.pipeline.openai import start_chat_completion
from tokenwire.pipeline.sessions import NO_THREADS, continued_head
from tokenwire.protocol.anthropic import (
    AnthropicMessageResponse,
    AnthropicStreamEvent,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
)
from tokenwire.protocol.generate import GenerateRequest

router = APIRouter(tags=["anthropic"])


@router.post(
    "/v1/messages",
    response_model=AnthropicMessageResponse,
    responses={**streamed(AnthropicStreamEvent), **MEDIA_ERRORS},
)
async def messages(body: MessagesRequest, request: Request) -> Response:
    pipeline = pipeline_of(request)
    session = session_header(request)
    continued = None
    thread = body.thread
    if thread is not None and thread.previous_message_id is not None:
        reply_id = thread.previous_message_id
        continued = await continued_head(pipeline, session, "thread", reply_id)
    elif thread is not None:  # create: what a session's turn does anyway
        if session is None:
            raise InvalidRequest(
                "thread: tokenwire holds a conversation in a session: send an X-Session-ID "
                "header, or no thread",
                "thread",
                NO_THREADS,
            )
        body = body.model_copy(update={"thread": None})
    chat = anthropic.chat_request(body, request_id=anthropic.new_message_id(), continued=continued)
    run = await admitted(
        request,
        pipeline,
        start_chat_completion(
            pipeline, chat, session=session, dialect="anthropic", continued=continued
        ),
    )
    if body.stream:
        return sse_response(anthropic.message_events(run), named=True)
    message = await unless_disconnected(request, anthropic.message(run))
    return OrjsonResponse(message, headers=run.session_headers())


@router.post(
    "/v1/messages/count_tokens",
    response_model=CountTokensResponse,
    responses=MEDIA_ERRORS,
    tags=[STATELESS],
)
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    return OrjsonResponse(await anthropic.count_tokens(pipeline_of(request), body))


@router.post(
    "/v1/messages/render", response_model=GenerateRequest, responses=MEDIA_ERRORS, tags=[STATELESS]
)
async def render_messages(body: MessagesRequest, request: Request) -> Response:
    return OrjsonResponse(await anthropic.render_messages(pipeline_of(request), body))
