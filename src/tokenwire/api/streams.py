"""Async stream plumbing shared by generate and the OpenAI routes: merging and SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

from tokenwire.api.errors import APIError, error_body
from tokenwire.api.responses import SSE_DONE, sse_event

T = TypeVar("T")


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with the stream's index.

    The first error of any stream ends the merge and is raised; leaving early (or an error)
    cancels every stream still running, which closes them (and aborts their engine requests).
    """
    queue: asyncio.Queue[tuple[int, T] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def sse_frames(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """``data: {json}`` per chunk, an error event if the stream fails, always ``[DONE]``.

    A client disconnect cancels this generator; the cancellation closes ``chunks``.
    """
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
    except APIError as exc:
        yield sse_event(error_body(exc.status, exc.message, exc.param))
    except Exception:
        yield sse_event(error_body(500, "Internal error while generating"))
    yield SSE_DONE


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
