"""Server-Sent Events for every streaming route: a chunk per event, errors in-band, [DONE]."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse

from tokenwire.api.errors import error_body, expected_error
from tokenwire.api.responses import SSE_DONE, sse_event

logger = logging.getLogger("tokenwire.api")


async def sse_frames(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """``data: {json}`` per chunk, an error event if the stream fails, always ``[DONE]``.

    A client disconnect cancels this generator; the cancellation closes ``chunks``.
    """
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
    except Exception as exc:
        expected = expected_error(exc)
        if expected is None:
            logger.exception("stream failed", exc_info=exc)
            expected = (500, "Internal error while generating", None)
        yield sse_event(error_body(*expected))
    yield SSE_DONE


def sse_response(
    chunks: AsyncIterator[dict[str, Any]], headers: dict[str, str] | None = None
) -> StreamingResponse:
    return StreamingResponse(sse_frames(chunks), media_type="text/event-stream", headers=headers)
