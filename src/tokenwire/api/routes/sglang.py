"""SGLang's native routes: ``/generate``, ``/abort_request``, ``/model_info``; and the load
endpoints routers poll (vllm-router's ``/get_load``, vLLM's ``/load``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenwire.api.admission import admitted
from tokenwire.api.control_key import require_control_key
from tokenwire.api.disconnect import unless_disconnected
from tokenwire.api.openapi import streamed
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.sse import sse_response
from tokenwire.api.state import pipeline_of
from tokenwire.pipeline.control import info
from tokenwire.pipeline.logprob_limit import apply_logprob_limit
from tokenwire.pipeline.sglang import start_sglang_generate
from tokenwire.protocol.control import AbortRequestBody
from tokenwire.protocol.responses import (
    GetLoadResponse,
    ModelInfo,
    ServerLoadResponse,
    SGLangGenerateResponse,
)
from tokenwire.protocol.sglang import SGLangGenerateRequest

router = APIRouter(tags=["sglang"])


@router.post(
    "/generate",
    # A batch, or a prompt with n > 1, is answered with a list.
    response_model=SGLangGenerateResponse | list[SGLangGenerateResponse],
    responses=streamed(SGLangGenerateResponse),
)
async def generate(body: SGLangGenerateRequest, request: Request) -> Response:
    pipeline = pipeline_of(request)
    apply_logprob_limit(pipeline, body)
    await admitted(request, pipeline)
    run = await start_sglang_generate(pipeline, body)
    if body.stream:
        return sse_response(run.chunks())
    return OrjsonResponse(await unless_disconnected(request, run.response()))


@router.post("/abort_request", response_class=Response)
async def abort_request(body: AbortRequestBody, request: Request) -> Response:
    if body.abort_all:  # every client's requests
        require_control_key(request)
    ids = None if body.abort_all else [body.rid]
    await pipeline_of(request).control.abort(ids)
    return Response(status_code=200)


@router.get("/model_info", response_model=ModelInfo)
async def model_info(request: Request) -> Response:
    return OrjsonResponse(info.model_info(pipeline_of(request)))


@router.get("/get_load", response_model=GetLoadResponse)
async def get_load(request: Request) -> Response:
    return OrjsonResponse({"load": pipeline_of(request).control.load()})


@router.get("/load", response_model=ServerLoadResponse)
async def load(request: Request) -> Response:
    return OrjsonResponse({"server_load": pipeline_of(request).control.load()})
