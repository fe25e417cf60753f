"""SGLang's native routes: ``/generate`` (which also takes vLLM's old demo-server body, as
atropos sends it), ``/abort_request``, ``/model_info``; and the load
endpoints routers poll (vllm-router's ``/get_load``, vLLM's ``/load``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenwire.api.admission import admitted
from tokenwire.api.control_key import STATELESS, require_control_key
from tokenwire.api.disconnect import unless_disconnected
from tokenwire.api.openapi import streamed
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.sse import sse_response
from tokenwire.api.state import pipeline_of
from tokenwire.pipeline.context import Pipeline
from tokenwire.pipeline.control import info
from tokenwire.pipeline.generate import start_generation
from tokenwire.pipeline.logprob_limit import apply_logprob_limit
from tokenwire.pipeline.sglang import start_sglang_generate
from tokenwire.pipeline.vllm_server import as_generate_request, vllm_server_answer
from tokenwire.protocol.control import AbortRequestBody
from tokenwire.protocol.responses import (
    GetLoadResponse,
    ModelInfo,
    ServerLoadResponse,
    SGLangGenerateResponse,
    VLLMServerGenerateResponse,
)
from tokenwire.protocol.vllm_server import GenerateBody, VLLMServerGenerateRequest

router = APIRouter(tags=["sglang"])


@router.post(
    "/generate",
    # A batch, or a prompt with n > 1, is answered with a list; atropos' body with its server's.
    response_model=SGLangGenerateResponse
    | list[SGLangGenerateResponse]
    | VLLMServerGenerateResponse,
    responses=streamed(SGLangGenerateResponse),
)
async def generate(body: GenerateBody, request: Request) -> Response:
    pipeline = pipeline_of(request)
    if isinstance(body, VLLMServerGenerateRequest):
        return await _vllm_server_generate(pipeline, body, request)
    apply_logprob_limit(pipeline, body)
    run = await admitted(request, pipeline, start_sglang_generate(pipeline, body))
    if body.stream:
        return sse_response(run.chunks())
    return OrjsonResponse(await unless_disconnected(request, run.response()))


async def _vllm_server_generate(
    pipeline: Pipeline, body: VLLMServerGenerateRequest, request: Request
) -> Response:
    """vLLM's old demo-server body on the same path (atropos' ``VLLMServer``)."""
    generate_request = as_generate_request(body)
    apply_logprob_limit(pipeline, generate_request)
    run = await admitted(
        request,
        pipeline,
        start_generation(pipeline, generate_request, generate_request.request_id),
    )
    generated = await unless_disconnected(request, run.response())
    return OrjsonResponse(await vllm_server_answer(pipeline, body, generated))


@router.post("/abort_request", response_class=Response)
async def abort_request(body: AbortRequestBody, request: Request) -> Response:
    if body.abort_all:  # every client's requests
        require_control_key(request)
    ids = None if body.abort_all else [body.rid]
    await pipeline_of(request).control.abort(ids)
    return Response(status_code=200)


@router.get("/model_info", response_model=ModelInfo, tags=[STATELESS])
async def model_info(request: Request) -> Response:
    return OrjsonResponse(info.model_info(pipeline_of(request)))


@router.get("/get_load", response_model=GetLoadResponse)
async def get_load(request: Request) -> Response:
    return OrjsonResponse({"load": pipeline_of(request).control.load()})


@router.get("/load", response_model=ServerLoadResponse)
async def load(request: Request) -> Response:
    return OrjsonResponse({"server_load": pipeline_of(request).control.load()})
