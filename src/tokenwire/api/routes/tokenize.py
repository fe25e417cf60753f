"""POST /tokenize and POST /detokenize."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenwire.api.control_key import STATELESS
from tokenwire.api.openapi import MEDIA_ERRORS
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.state import pipeline_of
from tokenwire.pipeline import tokenize as tokenizing
from tokenwire.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

router = APIRouter(tags=["tokenize", STATELESS])


@router.post("/tokenize", response_model=TokenizeResponse, responses=MEDIA_ERRORS)
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    return OrjsonResponse(await tokenizing.tokenize(pipeline_of(request), body))


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    return OrjsonResponse(await tokenizing.detokenize(pipeline_of(request), body))
