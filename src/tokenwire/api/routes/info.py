"""GET /v1/models, /health, /version, /metrics."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import PlainTextResponse, Response

from tokenwire import __version__
from tokenwire.api.control_key import CONTROL, STATELESS
from tokenwire.api.errors import error_response
from tokenwire.api.metrics import Metrics
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.state import pipeline_of
from tokenwire.engine.base import EngineDead
from tokenwire.pipeline.control.info import models
from tokenwire.protocol.responses import ModelList, VersionResponse

router = APIRouter(tags=["info"])
_STARTED = int(time.time())


@router.get("/v1/models", response_model=ModelList, tags=[STATELESS])
async def list_models(request: Request) -> Response:
    return OrjsonResponse({"object": "list", "data": models(pipeline_of(request), _STARTED)})


@router.get(
    "/health", response_class=Response, responses={200: {"description": "Ready (empty body)"}}
)
async def health(request: Request) -> Response:
    pipeline = pipeline_of(request)
    death = pipeline.engine_death
    if death is not None:
        return error_response(503, str(EngineDead(death)))
    if pipeline.shutting_down:
        return error_response(503, "The server is shutting down")
    if pipeline.runtime is None:
        return error_response(503, pipeline.load_error or "The model is loading")
    return Response(status_code=200)


@router.get("/version", response_model=VersionResponse, tags=[STATELESS])
async def version() -> Response:
    return OrjsonResponse({"version": __version__})


# The operator's: request counts and load say what other clients do.
@router.get("/metrics", response_class=PlainTextResponse, tags=[CONTROL])
async def metrics(request: Request) -> Response:
    registry: Metrics = request.app.state.metrics
    return Response(registry.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
