"""The one ASGI layer in front of FastAPI: request ids, metrics, API key, body checks, bugs.

One pure-ASGI pass (not ``BaseHTTPMiddleware``, not a chain of five middlewares each wrapping
``send``): every layer of a chain costs an await and a closure per request, and at ~100 µs of
server CPU for a whole short /tokenize those layers were a third of it. Streaming responses
pass through untouched. In order, for each HTTP request:

- ``X-Request-Id`` echoed back, or generated when the client sent none;
- 401 without a key (when the server has one): ``Authorization: Bearer KEY`` or ``x-api-key:
  KEY`` (Anthropic's header), on every path but /health and the load routes, compared in
  constant time, before the body is read; a control route (``api.control_key``) takes the
  control key only, any other route any key; the key that matched goes in the scope, as the
  credential that owns the sessions the request writes;
- the body read whole: 413 over the limit (declared or streamed), 408 if it does not arrive
  within ``read_timeout_s``, 400 for a lone UTF-16 surrogate, escaped (``"\\ud800"``) or
  encoded in UTF-8 (Python's JSON parser accepts both, but no tokenizer, template or
  serializer can use such a string);
- a direct route (``api.direct``) answered here; anything else handed to FastAPI;
- a bug answered as a JSON 500 with the connection kept usable (Starlette's own 500 handler
  re-raises after answering, and uvicorn then drops the connection without
  ``Connection: close``, so a pooled client's next request fails); a stream that already
  started cannot turn into a 500: its route ends it with an error event (``api.sse``);
- the request counted in the metrics by route, method and status.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenwire.api.control_key import (
    CONTROL_KEY_MISSING,
    CREDENTIAL,
    HOLDS_CONTROL_KEY,
    ROUTER_KEY_REFUSED,
    TaggedRoutes,
)
from tokenwire.api.deadlines import Deadlines
from tokenwire.api.direct import NO_BODY_METHODS, DirectRoutes
from tokenwire.api.errors import error_response
from tokenwire.api.metrics import Metrics
from tokenwire.ids import random_hex

logger = logging.getLogger("tokenwire.api")

REQUEST_ID_HEADER = b"x-request-id"
# vLLM checks no key on these; vllm-router polls the load routes with no key of the client's.
OPEN_PATHS = frozenset({"/health", "/get_load", "/load"})


@dataclass(frozen=True)
class FrontConfig:
    metrics: Metrics
    api_keys: tuple[str, ...]  # any of them opens the inference routes; () for none
    control_api_key: str | None  # None: the one ``api_keys`` (unsafe behind a router)
    router_api_key: str | None  # opens the stateless routes only (``api.control_key``)
    control_routes: TaggedRoutes
    stateless_routes: TaggedRoutes
    max_bytes: int
    read_timeout_s: float
    direct: DirectRoutes


class FrontedApp(FastAPI):
    """FastAPI with the front middleware outside every one of FastAPI's own layers.

    Added as a middleware, the front sat inside them: each request first paid FastAPI's
    telemetry check (three environment reads in opentelemetry), Starlette's error, telemetry
    and body-limit layers, and a wrapper of ``send`` for every message: about a tenth of a short
    generate's CPU, and a call per streamed chunk. Outside, a direct route meets none of them
    (nor FastAPI's native telemetry, which tokenwire does not configure); any other request goes
    on into FastAPI as before, less Starlette's ``ServerErrorMiddleware``: the front answers a
    bug with the JSON 500 and keeps the connection, where that layer would answer text/plain
    first and re-raise.
    """

    front: FrontMiddleware | None = None

    def set_front(self, config: FrontConfig) -> None:
        self.front = FrontMiddleware(super().__call__, config)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.front is not None:
            scope["app"] = self  # as Starlette sets it: routes find the app's state there
            await self.front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()
        if self.front is not None and isinstance(stack, ServerErrorMiddleware):
            return stack.app
        return stack


class FrontMiddleware:
    def __init__(self, app: ASGIApp, config: FrontConfig) -> None:
        self.app = app
        self.metrics = config.metrics
        self.inference_keys = tuple(key.encode() for key in config.api_keys)
        control = config.control_api_key or (config.api_keys[0] if config.api_keys else None)
        self.control_key = None if control is None else control.encode()
        self.router_key = None if config.router_api_key is None else config.router_api_key.encode()
        self.control_routes = config.control_routes
        self.stateless_routes = config.stateless_routes
        self.max_bytes = config.max_bytes
        self.read_timeout_s = config.read_timeout_s
        # A body may arrive up to a tenth of its time (a second at most) past its deadline.
        self.read_deadlines = Deadlines(min(config.read_timeout_s / 10, 1.0))
        self.direct = config.direct

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0  # until the response starts

        async def front_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = message.get("headers") or []
                # A route that resolved its own id (e.g. from the body) has set it already; an
                # id is made only for a response without one.
                if all(key.lower() != REQUEST_ID_HEADER for key, _ in headers):
                    request_id = header(scope, REQUEST_ID_HEADER) or random_hex().encode()
                    message["headers"] = [*headers, (REQUEST_ID_HEADER, request_id)]
            await send(message)

        try:
            await self._handle(scope, receive, front_send)
        except asyncio.CancelledError:
            # Only the server's shutdown cancels a request (a client leaving does not): one
            # not answered yet gets the JSON 503 of every request refused at shutdown.
            if status:
                raise
            await error_response(503, "The server is shutting down")(scope, receive, front_send)
        except Exception as exc:
            if status:
                raise
            logger.exception("unhandled error", exc_info=exc)
            await error_response(500, "Internal server error")(scope, receive, front_send)
        finally:
            route = scope.get("route")
            # Unmatched paths share one label so scanners cannot blow up the label set.
            route_name = getattr(route, "path", None) or "unmatched"
            self.metrics.observe_request(
                route_name, scope["method"], status or 500, time.perf_counter() - started
            )

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        refusal = self._authorize(scope, method)
        if refusal is not None:
            response = error_response(401, refusal)
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        route = self.direct.get((method, scope["path"]))
        if method in NO_BODY_METHODS:
            if route is not None and await route.answer(scope, receive, send, None):
                return
            await self.app(scope, receive, send)
            return
        body = await self._body(scope, receive, send)
        if body is None:  # answered (an error), or the client went away
            return
        replayed = False

        async def replay() -> Message:
            # The body read here once more first: for FastAPI, or a route's request.body().
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if route is not None and await route.answer(scope, replay, send, body):
            return
        await self.app(scope, replay, send)

    def _authorize(self, scope: Scope, method: str) -> str | None:
        """Why the request is refused (None: it may go on); notes in the scope whether it holds
        the control key, for routes where the body decides (``require_control_key``), and the
        key it sent (``CREDENTIAL``)."""
        given = _presented(scope)
        control = self.control_key
        holds_control = control is None or _is_one_of(given, (control,))
        scope[HOLDS_CONTROL_KEY] = holds_control
        scope[CREDENTIAL] = given
        path = scope["path"]
        if path in OPEN_PATHS or holds_control:
            return None
        if self.control_routes.need_key(method, path):
            return CONTROL_KEY_MISSING
        if self.inference_keys and not _is_one_of(given, self.inference_keys):
            if self.router_key is not None and _is_one_of(given, (self.router_key,)):
                if self.stateless_routes.need_key(method, path):
                    return None
                return ROUTER_KEY_REFUSED
            return "Missing or invalid API key"
        return None

    async def _body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None once the refusal is answered (or the client is gone)."""
        declared = header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._too_large(scope, receive, send)
            return None
        try:
            with self.read_deadlines.within(self.read_timeout_s):
                body = await self._read(receive)
        except TimeoutError:
            timeout = f"The request body did not arrive within {self.read_timeout_s:g} s"
            await error_response(408, timeout)(scope, receive, send)
            return None
        if isinstance(body, int):
            await self._too_large(scope, receive, send)
            return None
        if body is not None and (has_lone_surrogate(body) or has_encoded_surrogate(body)):
            message = (
                "The request body holds a lone UTF-16 surrogate (e.g. \\ud800, escaped or "
                "encoded in UTF-8): strings must be valid Unicode"
            )
            await error_response(400, message)(scope, receive, send)
            return None
        return body

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"Request body exceeds {self.max_bytes} bytes"
        await error_response(413, message)(scope, receive, send)

    async def _read(self, receive: Receive) -> bytes | int | None:
        """The whole body; its size past the limit (an int) if too large; None on disconnect."""
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body = message.get("body", b"")
        if not message.get("more_body", False):  # the usual case: one message
            return body if len(body) <= self.max_bytes else len(body)
        chunks = [body]
        size = len(body)
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


def _presented(scope: Scope) -> bytes | None:
    """The key a request sends: ``x-api-key: KEY`` (Anthropic's header, the one its API
    checks; older SDKs and litellm send only this), else ``Authorization: Bearer KEY``."""
    api_key = header(scope, b"x-api-key")
    if api_key is not None:
        return api_key
    authorization = header(scope, b"authorization")
    if authorization is not None and authorization.startswith(b"Bearer "):
        return authorization[7:]
    return None


def _is_one_of(given: bytes | None, keys: tuple[bytes, ...]) -> bool:
    """Whether ``given`` is one of ``keys``, each compared in constant time (no early exit,
    so the time says nothing of which key came close)."""
    found = False
    for key in keys:
        found |= given is not None and hmac.compare_digest(given, key)
    return found


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


# A \uD800-\uDFFF escape. Its literal prefix (``\\u``) lets the regex engine skip to each
# candidate instead of trying every byte (a lookbehind first left it none: 32 ms on a 74K-token
# /extend body); whether the backslash is itself escaped is checked per match.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_HIGH = frozenset(b"89abAB")
_BACKSLASH = 0x5C
# What may be a lone surrogate, found at C speed from the same literal prefix: a surrogate escape
# after a backslash (its own may be escaped), a high one not followed by a low one, a low one not
# preceded by a high one. A body without any has none (a body of emoji pairs is not walked in
# Python); one with some goes through the exact walk.
_HEX2 = rb"[0-9a-fA-F]{2}"
_MAYBE_LONE = re.compile(
    rb"\\u[dD](?:(?<=\\\\u[dD])"
    rb"|[89abAB]" + _HEX2 + rb"(?!\\u[dD][c-fC-F])"
    rb"|[c-fC-F](?<!\\u[dD][89abAB]" + _HEX2 + rb"\\u[dD][c-fC-F]))"
)


# A surrogate encoded in UTF-8 (ED A0..BF ..): not UTF-8, but json.loads, which FastAPI calls,
# decodes bytes with "surrogatepass" and reads it as a lone surrogate (a 500 in the tokenizer).
_ENCODED_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def has_encoded_surrogate(body: bytes) -> bool:
    return b"\xed" in body and _ENCODED_SURROGATE.search(body) is not None


def has_lone_surrogate(body: bytes) -> bool:
    """Whether a JSON text escapes a surrogate that is not half of a high+low pair."""
    if b"\\u" not in body or _MAYBE_LONE.search(body) is None:
        return False
    pending_high_end = -1  # where an unpaired high surrogate escape ended
    for match in _SURROGATE_ESCAPE.finditer(body):
        start = match.start()
        if _escaped(body, start):
            continue  # ``\\ud800``: a backslash, then text
        is_high = body[start + 3] in _HIGH
        if pending_high_end != -1:
            if is_high or start != pending_high_end:
                return True
            pending_high_end = -1
        elif is_high:
            pending_high_end = match.end()
        else:
            return True
    return pending_high_end != -1


def _escaped(body: bytes, at: int) -> bool:
    """Whether the backslash at ``at`` follows an odd run of backslashes (it is escaped)."""
    run = 0
    while at - run > 0 and body[at - run - 1] == _BACKSLASH:
        run += 1
    return run % 2 == 1
