"""POST /v1/chat/completions/extend: the next turn's prompt from the previous turn's ids."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenwire.api.control_key import STATELESS
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.state import owner_of, pipeline_of
from tokenwire.pipeline.extend import extend_chat
from tokenwire.protocol.extend import ExtendRequest
from tokenwire.protocol.responses import ExtendResponse

router = APIRouter(tags=["render", STATELESS])


@router.post("/v1/chat/completions/extend", response_model=ExtendResponse)
async def extend_chat_completion(body: ExtendRequest, request: Request) -> Response:
    return OrjsonResponse(await extend_chat(pipeline_of(request), body, owner_of(request)))
