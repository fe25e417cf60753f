"""POST /inference/v1/generate and POST /abort_requests: token ids in, token ids out."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenwire.api.admission import admitted
from tokenwire.api.asgi import REQUEST_ID_HEADER, header
from tokenwire.api.control_key import require_control_key
from tokenwire.api.disconnect import unless_disconnected
from tokenwire.api.openapi import MEDIA_ERRORS, streamed
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.sse import sse_response
from tokenwire.api.state import pipeline_of
from tokenwire.pipeline import generate as generation
from tokenwire.pipeline.logprob_limit import apply_logprob_limit
from tokenwire.protocol.control import AbortRequestsBody, InferenceAbortBody
from tokenwire.protocol.generate import GenerateRequest
from tokenwire.protocol.responses import AbortResponse, GenerateChunk, GenerateResponse

router = APIRouter(tags=["generate"])


@router.post(
    "/inference/v1/generate",
    response_model=GenerateResponse,
    responses={**streamed(GenerateChunk), **MEDIA_ERRORS},
)
async def generate(body: GenerateRequest, request: Request) -> Response:
    # The X-Request-Id header wins over the body's request_id. Read from the scope: Starlette's
    # ``request.headers`` builds an object for it (2 µs).
    given = header(request.scope, REQUEST_ID_HEADER)
    request_id = given.decode("latin-1") if given else body.request_id
    pipeline = pipeline_of(request)
    apply_logprob_limit(pipeline, body)
    run = await admitted(request, pipeline, generation.start_generation(pipeline, body, request_id))
    headers = {"X-Request-Id": request_id}
    if body.stream:
        return sse_response(run.chunks(), headers)
    return OrjsonResponse(await unless_disconnected(request, run.response()), headers=headers)


@router.post("/abort_requests", response_model=AbortResponse)
async def abort_requests(body: AbortRequestsBody, request: Request) -> Response:
    """vLLM's: missing or empty ``request_ids`` aborts every running request (every client's:
    that needs the control key)."""
    if not body.request_ids:
        require_control_key(request)
    aborted = await pipeline_of(request).control.abort(body.request_ids)
    return OrjsonResponse({"status": "aborted", "aborted": aborted})


@router.post("/inference/v1/abort_requests", response_class=Response)
async def inference_abort_requests(body: InferenceAbortBody, request: Request) -> Response:
    if body.request_ids:  # unlike /abort_requests, an empty list aborts nothing
        await pipeline_of(request).control.abort(body.request_ids)
    return Response(status_code=200)
