"""Small pure-ASGI middlewares: request ids, API key, body size limit.

Pure ASGI (not ``BaseHTTPMiddleware``) because each layer then costs microseconds per request,
and streaming responses pass through untouched.
"""

from __future__ import annotations

import asyncio
import hmac
import re
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


class RequestBodyMiddleware:
    """Reads a request body whole, then hands it to the app; refuses what must not reach it.

    - 413 for bodies over the limit, declared (Content-Length) or streamed (chunked);
    - 408 for a body that does not arrive within ``read_timeout_s`` (a client that never
      finishes would otherwise hold its connection and its buffers open);
    - 400 for a JSON body with a lone UTF-16 surrogate escape (``"\\ud800"``): Python's JSON
      parser accepts it, but no tokenizer, template or serializer can use such a string.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        too_large = error_response(413, f"Request body exceeds {self.max_bytes} bytes")
        declared = header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await too_large(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.read_timeout_s)
        except TimeoutError:
            timeout = f"The request body did not arrive within {self.read_timeout_s:g} s"
            await error_response(408, timeout)(scope, receive, send)
            return
        if body is None:  # the client went away
            return
        if isinstance(body, int):
            await too_large(scope, receive, send)
            return
        if has_lone_surrogate(body):
            message = (
                "The request body holds a lone UTF-16 surrogate escape (e.g. \\ud800): "
                "strings must be valid Unicode"
            )
            await error_response(400, message)(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | int | None:
        """The whole body; its size past the limit (an int) if too large; None on disconnect."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return size
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


# A \uD800-\uDFFF escape not itself escaped (an even number of backslashes before it).
_SURROGATE_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u[dD]([89abAB]|[c-fC-F])[0-9a-fA-F]{2}")
_HIGH = frozenset(b"89abAB")


def has_lone_surrogate(body: bytes) -> bool:
    """Whether a JSON text escapes a surrogate that is not half of a high+low pair."""
    if b"\\u" not in body:
        return False
    pending_high_end = -1  # where an unpaired high surrogate escape ended
    for match in _SURROGATE_ESCAPE.finditer(body):
        start = match.end() - 6  # the escape itself, after any escaped backslashes
        is_high = match.group(1)[0] in _HIGH
        if pending_high_end != -1:
            if is_high or start != pending_high_end:
                return True
            pending_high_end = -1
        elif is_high:
            pending_high_end = match.end()
        else:
            return True
    return pending_high_end != -1
