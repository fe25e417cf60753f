"""One error body for every failure, and the mapping from exceptions to it.

Clients (and vLLM-speaking RL libraries) read ``{"error": {message, type, param, code}}``;
validation failures are 400 like vLLM's, not FastAPI's default 422.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from tokenwire.api.responses import OrjsonResponse
from tokenwire.engine.base import EngineDead
from tokenwire.media.errors import MediaError
from tokenwire.pipeline.errors import (
    ClientGone,
    InvalidRequest,
    NotFound,
    NotReady,
    PipelineError,
    SessionClosed,
    UnknownModel,
    UnknownSession,
)

ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An expected failure with a status for the client."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


# The pipeline's domain errors and the HTTP status each one means.
PIPELINE_STATUS: dict[type[PipelineError], int] = {
    InvalidRequest: 400,
    UnknownModel: 404,
    NotFound: 404,
    UnknownSession: 404,
    SessionClosed: 409,
    ClientGone: 499,
    NotReady: 503,
}


def expected_error(exc: BaseException) -> tuple[int, str, str | None] | None:
    """Status, message and param of a failure the client caused or should be told about;
    None for a bug (a 500)."""
    if isinstance(exc, PipelineError):
        return PIPELINE_STATUS.get(type(exc), 400), exc.message, exc.param
    if isinstance(exc, EngineDead):  # a server fault: another replica can serve the request
        return 503, str(exc), None
    if isinstance(exc, MediaError):
        # Refusals (SSRF rules, limits, bad images or features) are 400; a remote 4xx is 422.
        return exc.status, exc.message, exc.param
    if isinstance(exc, APIError):
        return exc.status, exc.message, exc.param
    return None


def error_body(
    status: int, message: str, param: str | None = None, details: dict[str, object] | None = None
) -> dict[str, object]:
    error_type = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    error: dict[str, object] = {"message": message, "type": error_type, "param": param}
    error["code"] = status
    if details is not None:
        error["details"] = details
    return {"error": error}


def error_response(
    status: int, message: str, param: str | None = None, details: dict[str, object] | None = None
) -> Response:
    return OrjsonResponse(error_body(status, message, param, details), status_code=status)


_UNION_TAGS = frozenset(
    {"chat", "completion", "whole", "stream", "function-after[]", "sglang", "vllm_server"}
)
NOT_JSON = "The request body must be JSON: send it with Content-Type: application/json"


def describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """A message that names the offending field, e.g. ``body.tokens.0: Input should be...``."""
    parts = []
    first_param: str | None = None
    for error in exc.errors()[:5]:
        if error.get("type") == "json_invalid":
            position = error.get("loc", ("body", "?"))[-1]
            return f"Invalid JSON body (at character {position})", None
        # The part of the request (body, query string) is not part of the field's name.
        loc = [str(item) for item in error.get("loc", ()) if item not in ("body", "query")]
        # Tagged unions add the tag to the location; it names no field.
        loc = [item for item in loc if item not in _UNION_TAGS]
        field = ".".join(loc)
        first_param = first_param or field or None
        message = str(error.get("msg", "invalid value"))
        message = message.removeprefix("Value error, ")
        parts.append(f"{field}: {message}" if field else message)
    return "; ".join(parts) or "Invalid request", first_param


def exception_response(request: Request, exc: Exception) -> Response | None:
    """The error response for an exception a route may raise; None for a bug (a 500)."""
    if isinstance(exc, RequestValidationError):
        errors = exc.errors()
        # A bad query parameter is named first: it is wrong whatever the body holds.
        query_errors = [error for error in errors if error.get("loc", ())[:1] == ("query",)]
        if query_errors:
            message, param = describe_validation_error(RequestValidationError(query_errors))
            return error_response(400, message, param)
        content_type = request.headers.get("content-type", "")
        body_failed = any(error.get("loc", ())[:1] == ("body",) for error in errors)
        if request.method == "POST" and "json" not in content_type and body_failed:
            # FastAPI only parses JSON bodies sent as JSON (curl -d sends a form type).
            return error_response(400, NOT_JSON, "Content-Type")
        message, param = describe_validation_error(exc)
        return error_response(400, message, param)
    if isinstance(exc, StarletteHTTPException):
        detail = exc.detail
        message = detail if isinstance(detail, str) else HTTPStatus(exc.status_code).phrase
        return error_response(exc.status_code, message)
    expected = expected_error(exc)
    if expected is None:
        return None
    details = exc.details if isinstance(exc, PipelineError) else None
    return error_response(*expected, details)


def install_error_handlers(app: FastAPI) -> None:
    """FastAPI's handlers for what its routes raise (the direct routes call the same)."""

    async def handle(request: Request, exc: Exception) -> Response:
        response = exception_response(request, exc)
        if response is None:
            raise exc
        return response

    kinds = (
        APIError,
        PipelineError,
        MediaError,
        EngineDead,
        RequestValidationError,
        StarletteHTTPException,
    )
    for kind in kinds:
        app.add_exception_handler(kind, handle)
