"""A frontend's routes that are the core's: forwarded whole to the core's HTTP socket.

Under ``--api-server-count`` a frontend serves the routes whose work is per request (see
``FRONTEND_PATHS``) and forwards every other request (and every one until it has loaded), as
its client sent it, to the core (the control routes, sessions, extend and render with their
remembered prompts, metrics, ...): the core checks keys and bodies for those as one process
does, and its answer, streamed or not, goes back byte for byte. A client that leaves closes the
forwarded request, which ends it in the core as a disconnect does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenwire.api.errors import error_response
from tokenwire.pipeline.context import Pipeline

# What a frontend answers itself: the text work and the generating routes, each dialect's. A
# request of a session (X-Session-ID) goes to the core, which owns them: without one, nothing a
# generating route does outlives its answer (Anthropic's threads and the Responses API's
# stored responses are a session's).
FRONTEND_PATHS = frozenset(
    {
        "/tokenize",
        "/detokenize",
        "/inference/v1/generate",
        "/v1/completions",
        "/v1/chat/completions",
        "/generate",
        "/v1/messages",
        "/v1/responses",
    }
)
_SESSION_HEADER = b"x-session-id"
# Connection-level headers, which each hop sets for itself.
_HOP_HEADERS = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"te", b"trailer"}
)


class ForwardToCore:
    """The frontend's ASGI app: its own routes to ``local``, any other request to the core."""

    def __init__(self, local: ASGIApp, pipeline: Pipeline, core_http_path: str) -> None:
        self.local = local
        self.pipeline = pipeline
        self.client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=core_http_path),
            base_url="http://core",
            timeout=None,  # the core applies its own timeouts, as to any client
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._serves_here(scope):
            await self.local(scope, receive, send)
            return
        await self._forward(scope, receive, send)

    def _serves_here(self, scope: Scope) -> bool:
        # Until this frontend's own model parts are loaded, the core answers all it accepts, as
        # one process does: the port is shared, and a frontend a little behind the others would
        # refuse (503) what a client sent once /health said 200 on another one.
        if self.pipeline.runtime is None or scope["path"] not in FRONTEND_PATHS:
            return False
        return not any(name == _SESSION_HEADER for name, _ in scope["headers"])

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = asyncio.Event()

        async def body() -> AsyncIterator[bytes]:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    return
                chunk = message.get("body", b"")
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    return

        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP_HEADERS]
        path = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            path += b"?" + scope["query_string"]
        request = self.client.build_request(
            scope["method"], path.decode("latin-1"), headers=headers, content=body()
        )
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            await error_response(503, f"The core process did not answer: {exc}")(
                scope, receive, send
            )
            return
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(response.aclose)
            watch = asyncio.create_task(_until_disconnect(receive, disconnected))
            stack.callback(watch.cancel)
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [
                        (k, v) for k, v in response.headers.raw if k.lower() not in _HOP_HEADERS
                    ],
                }
            )
            relay = asyncio.create_task(_relay(response, send))
            await asyncio.wait({relay, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not relay.done():  # the client left: closing the response ends it in the core
                relay.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await relay
                return
            relay.result()


async def _relay(response: httpx.Response, send: Send) -> None:
    async for chunk in response.aiter_raw():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _until_disconnect(receive: Receive, disconnected: asyncio.Event) -> None:
    if disconnected.is_set():
        return
    while (await receive())["type"] != "http.disconnect":
        pass
