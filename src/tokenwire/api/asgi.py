"""Small pure-ASGI middlewares: request ids, API key, body size limit.

Pure ASGI (not ``BaseHTTPMiddleware``) because each layer then costs microseconds per request,
and streaming responses pass through untouched.
"""

from __future__ import annotations

import hmac
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenwire.api.errors import error_response

REQUEST_ID_HEADER = b"x-request-id"
OPEN_PATHS = frozenset({"/health"})


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


class RequestIdMiddleware:
    """Echo ``X-Request-Id`` back, generating one when the client sent none."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = header(scope, REQUEST_ID_HEADER) or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                # A route that resolved its own id (e.g. from the body) has set it already.
                if all(key.lower() != REQUEST_ID_HEADER for key, _ in headers):
                    headers.append((REQUEST_ID_HEADER, request_id))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_id)


class ApiKeyMiddleware:
    """``Authorization: Bearer KEY`` on every route but /health, compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "Missing or invalid API key")
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over the limit, declared (Content-Length) or streamed (chunked)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        too_large = error_response(413, f"Request body exceeds {self.max_bytes} bytes")
        declared = header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.max_bytes:
                await too_large(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        # No length given: read it all here, counting, then replay it to the app.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await too_large(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
