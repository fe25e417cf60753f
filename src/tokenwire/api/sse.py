"""Server-Sent Events for every streaming route: a chunk per event, errors in-band, [DONE]."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokenwire.api.disconnect import DisconnectWatch
from tokenwire.api.errors import error_body, expected_error
from tokenwire.api.responses import SSE_DONE, sse_event

logger = logging.getLogger("tokenwire.api")


class SSEResponse(Response):
    """``data: {json}`` per chunk, an error event if the stream fails, then ``[DONE]``.

    ``named``: the form of Anthropic's and OpenAI Responses' streams, whose chunks carry their
    event's ``type``: ``event: TYPE`` before each ``data:``. A named stream that completes ends
    with the same ``data: [DONE]`` (their SDKs skip it); one that fails ends at its
    ``event: error`` with ``{"type": "error", "error": {...}}``, with no ``[DONE]`` after it.

    Sent from the request's own task, each chunk framed where it is sent: Starlette's
    ``StreamingResponse`` ran the stream in a second task under an anyio task group (the
    request's task listening for the disconnect) and took its frames from one more generator,
    a task group, a task and a cancel scope per request and a generator step per chunk. Here a
    ``DisconnectWatch`` cancels this task when the client leaves. However the response ends
    (sent, client gone, server shutting down), ``chunks`` is closed, and so the job's engine
    requests with it.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        chunks: AsyncIterator[dict[str, Any]],
        headers: dict[str, str] | None = None,
        *,
        named: bool = False,
    ) -> None:
        self.chunks = chunks
        self.named = named
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = DisconnectWatch(receive)
        try:
            async with contextlib.aclosing(self.chunks):
                status, headers = self.status_code, self.raw_headers
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await self._send_events(send)
        except asyncio.CancelledError:
            if not watch.gone:
                raise  # the server's shutdown
        finally:
            watch.stop()
        if watch.gone:  # the cancellation was ours (swallowed or not): nothing above sees it
            watch.task.uncancel()

    async def _send_events(self, send: Send) -> None:
        named = self.named
        sending = False  # an error while sending is the server's, not the stream's
        try:
            async for chunk in self.chunks:
                frame = sse_event(chunk)
                if named:
                    frame = b"event: " + chunk["type"].encode() + b"\n" + frame
                sending = True
                await send({"type": "http.response.body", "body": frame, "more_body": True})
                sending = False
        except Exception as exc:
            if sending:
                raise
            expected = expected_error(exc)
            if expected is None:
                logger.exception("stream failed", exc_info=exc)
                expected = (500, "Internal error while generating", None)
            if named:
                frame = b"event: error\n" + sse_event({"type": "error", **error_body(*expected)})
                await send({"type": "http.response.body", "body": frame, "more_body": False})
                return
            frame = sse_event(error_body(*expected))
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        # [DONE] with the end of the body: the same bytes on the wire as two messages.
        await send({"type": "http.response.body", "body": SSE_DONE, "more_body": False})


def sse_response(
    chunks: AsyncIterator[dict[str, Any]],
    headers: dict[str, str] | None = None,
    *,
    named: bool = False,
) -> SSEResponse:
    return SSEResponse(chunks, headers, named=named)
