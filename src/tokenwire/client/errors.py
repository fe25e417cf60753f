"""Typed errors of the client, built from the server's one error body.

Every failure the server reports has ``{"error": {"message", "type", "param", "code"}}``; the
status picks the class, so callers catch what they can handle (``BadRequestError`` for their own
input, ``ServiceUnavailableError`` while the model loads) and let the rest propagate.
"""

from __future__ import annotations

from typing import Any

import httpx


class TokenwireError(Exception):
    """Base of every error this client raises."""


class APIConnectionError(TokenwireError):
    """The server could not be reached, or the connection broke mid-answer."""


class APIStatusError(TokenwireError):
    """The server answered with an error status; ``message`` and ``param`` come from its body."""

    status_code: int = 0

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        error_type: str | None = None,
        param: str | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(f"{status_code}: {message}")
        self.message = message
        self.status_code = status_code
        self.error_type = error_type
        self.param = param
        self.body = body


class BadRequestError(APIStatusError):
    """400: the request is invalid; ``param`` names the field."""


class AuthenticationError(APIStatusError):
    """401: missing or wrong API key."""


class NotFoundError(APIStatusError):
    """404: unknown model or route."""


class RequestTooLargeError(APIStatusError):
    """413: the body is over the server's --max-request-bytes."""


class UnprocessableEntityError(APIStatusError):
    """422: a media URL answered with a client error."""


class InternalServerError(APIStatusError):
    """5xx other than 503: a server bug."""


class ServiceUnavailableError(APIStatusError):
    """503: the model is loading or the server is shutting down."""


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    404: NotFoundError,
    413: RequestTooLargeError,
    422: UnprocessableEntityError,
    503: ServiceUnavailableError,
}


def status_error(status_code: int, body: Any) -> APIStatusError:
    """The error for a status and a decoded body (the error object, or anything else)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        error = {"message": str(body) if body else f"HTTP {status_code}"}
    kind = _BY_STATUS.get(status_code)
    if kind is None:
        kind = InternalServerError if status_code >= 500 else APIStatusError
    return kind(
        str(error.get("message", "")),
        status_code=status_code,
        error_type=error.get("type"),
        param=error.get("param"),
        body=body,
    )


def response_error(response: httpx.Response) -> APIStatusError:
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    return status_error(response.status_code, body)
