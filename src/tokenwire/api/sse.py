"""Server-Sent Events for every streaming route: a chunk per event, errors in-band, [DONE]."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenwire.api.errors import error_body, expected_error
from tokenwire.api.responses import SSE_DONE, sse_event

logger = logging.getLogger("tokenwire.api")


async def sse_frames(
    chunks: AsyncIterator[dict[str, Any]], *, named: bool = False
) -> AsyncIterator[bytes]:
    """``data: {json}`` per chunk, an error event if the stream fails, then ``[DONE]``.

    ``named``: the form of Anthropic's and OpenAI Responses' streams, whose chunks carry their
    event's ``type``: ``event: TYPE`` before each ``data:``. A named stream that completes ends
    with the same ``data: [DONE]`` (their SDKs skip it); one that fails ends at its
    ``event: error`` with ``{"type": "error", "error": {...}}``, with no ``[DONE]`` after it.

    Closing it closes ``chunks`` (and so the job's engine requests), as ``SSEResponse`` does
    when the client goes away between two chunks.
    """
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if named:
                    yield b"event: " + chunk["type"].encode() + b"\n" + sse_event(chunk)
                else:
                    yield sse_event(chunk)
    except Exception as exc:
        expected = expected_error(exc)
        if expected is None:
            logger.exception("stream failed", exc_info=exc)
            expected = (500, "Internal error while generating", None)
        if named:
            yield b"event: error\n" + sse_event({"type": "error", **error_body(*expected)})
            return
        yield sse_event(error_body(*expected))
    yield SSE_DONE


class SSEResponse(StreamingResponse):
    """A stream whose frames are closed when the response ends however it ends: a client that
    leaves while a chunk is being sent would otherwise leave them suspended, its job running,
    until a garbage collection found them."""

    body_iterator: AsyncGenerator[bytes, None]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def sse_response(
    chunks: AsyncIterator[dict[str, Any]],
    headers: dict[str, str] | None = None,
    *,
    named: bool = False,
) -> StreamingResponse:
    return SSEResponse(
        sse_frames(chunks, named=named), media_type="text/event-stream", headers=headers
    )
