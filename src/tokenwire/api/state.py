"""The one way a route reaches the pipeline: ``pipeline_of(request)``.

Routes call it directly: FastAPI's dependency solving cost more per request than the whole
tokenizer call of a short prompt.
"""

from __future__ import annotations

from starlette.requests import Request

from tokenwire.api.control_key import CREDENTIAL, HOLDS_CONTROL_KEY
from tokenwire.pipeline.context import Pipeline
from tokenwire.pipeline.session_store import Owner
from tokenwire.pipeline.sessions import SessionKey, session_id_of


def pipeline_of(request: Request) -> Pipeline:
    return request.app.state.pipeline


def owner_of(request: Request) -> Owner:
    """Who the request is, to the session store: its credential (as the front middleware
    matched it) and whether that is the control key."""
    scope = request.scope
    return Owner.of(scope.get(CREDENTIAL), control=scope.get(HOLDS_CONTROL_KEY, False))


def session_header(request: Request) -> SessionKey | None:
    """The session a request belongs to (``X-Session-ID``, the header vllm-router keys on)."""
    session_id = session_id_of(request.headers.get("x-session-id"))
    return None if session_id is None else SessionKey(session_id, owner_of(request))
