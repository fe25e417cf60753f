"""Shared pieces of the wire schema: the error body and the base request model."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class RequestModel(BaseModel):
    """Base of every request body: unknown fields are ignored, as vLLM does for OpenAI bodies."""

    model_config = ConfigDict(extra="ignore")


class StrictRequestModel(BaseModel):
    """Base of bodies where an unknown field is a client bug worth a 400 (sampling params)."""

    model_config = ConfigDict(extra="forbid")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
