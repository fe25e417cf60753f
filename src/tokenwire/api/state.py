"""The one way a route reaches the pipeline: ``pipeline_of(request)``.

Routes call it directly: FastAPI's dependency solving cost more per request than the whole
tokenizer call of a short prompt.
"""

from __future__ import annotations

from starlette.requests import Request

from tokenwire.pipeline.context import Pipeline


def pipeline_of(request: Request) -> Pipeline:
    return request.app.state.pipeline
