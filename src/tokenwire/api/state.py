"""The one way a route reaches the pipeline: ``pipeline_of(request)``.

Routes call it directly: FastAPI's dependency solving cost more per request than the whole
tokenizer call of a short prompt.
"""

from __future__ import annotations

from starlette.requests import Request

from tokenwire.pipeline.context import Pipeline
from tokenwire.pipeline.sessions import session_id_of


def pipeline_of(request: Request) -> Pipeline:
    return request.app.state.pipeline


def session_header(request: Request) -> str | None:
    """The session a request belongs to (``X-Session-ID``, the header vllm-router keys on)."""
    return session_id_of(request.headers.get("x-session-id"))
