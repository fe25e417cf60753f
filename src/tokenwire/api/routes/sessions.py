"""Recorded sessions: GET /v1/sessions, GET and DELETE /v1/sessions/{session_id}, and GET
/v1/sessions/{session_id}/view (the same, as a page).

A session is its owner's (the credential that created it) and the control key's: to any other
key it does not exist (404), and the list holds only the caller's own sessions.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import HTMLResponse, Response

from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.state import owner_of, pipeline_of
from tokenwire.pipeline.errors import UnknownSession
from tokenwire.pipeline.session_view import view_html
from tokenwire.pipeline.sessions import trajectory

router = APIRouter(tags=["sessions"])


class SessionInfo(BaseModel):
    id: str
    turns: int
    bytes: int
    created: float
    updated: float
    closed: str | None  # why it takes no more turns (its byte bound); None while it does


class SessionList(BaseModel):
    object: str
    data: list[SessionInfo]


class Trajectory(BaseModel):
    id: str
    closed: str | None
    # Each turn: turn, segment, dialect, prompt_ids, sampled_ids, logprobs, finish_reason,
    # weight_versions.
    turns: list[dict[str, Any]]
    # Each segment: segment, reason, turns, token_ids, loss_mask.
    segments: list[dict[str, Any]]


class Deleted(BaseModel):
    id: str
    deleted: bool


VIEW_POLICY = "default-src 'none'; style-src 'unsafe-inline'"
_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "Unknown session"}}


@router.get("/v1/sessions", response_model=SessionList)
async def list_sessions(request: Request) -> Response:
    sessions = await pipeline_of(request).session_store().sessions(owner_of(request))
    return OrjsonResponse({"object": "list", "data": sessions})


@router.get("/v1/sessions/{session_id}", response_model=Trajectory, responses=_NOT_FOUND)
async def get_session(session_id: str, request: Request) -> Response:
    store = pipeline_of(request).session_store()
    return OrjsonResponse(await trajectory(store, session_id, owner_of(request)))


@router.get(
    "/v1/sessions/{session_id}/view",
    response_class=HTMLResponse,
    responses={**_NOT_FOUND, 200: {"content": {"text/html": {}}}},
)
async def view_session(session_id: str, request: Request) -> Response:
    """The session as a page: each turn's tokens, sampled ones shaded by logprob."""
    pipeline = pipeline_of(request)
    recorded = await trajectory(pipeline.session_store(), session_id, owner_of(request))
    decoder = pipeline.ready().decoder
    page = await asyncio.to_thread(view_html, recorded, decoder)
    # The page is recorded model output: should any of it ever escape its escaping, nothing in
    # it may run or load.
    return HTMLResponse(page, headers={"Content-Security-Policy": VIEW_POLICY})


@router.delete("/v1/sessions/{session_id}", response_model=Deleted, responses=_NOT_FOUND)
async def delete_session(session_id: str, request: Request) -> Response:
    if not await pipeline_of(request).session_store().delete(session_id, owner_of(request)):
        raise UnknownSession(f"session {session_id!r} does not exist", "session_id")
    return OrjsonResponse({"id": session_id, "deleted": True})
