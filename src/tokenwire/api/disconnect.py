"""Abort work whose client went away: a closed connection must free its engine slot.

One waiter per request, parked in ``receive()`` until the server delivers ``http.disconnect``
(uvicorn does once the body was read and the connection is lost): no timer, so a request waiting
on the engine costs no CPU however long it waits. Polling ``is_disconnected()`` every 50 ms cost
about 1.4 ms of CPU per in-flight request-second (1.4 cores for 1,024 requests in flight).

The waiter starts only once the work has given the event loop a turn: an answer ready in the
step that asked for it (an engine that answers at once, a refusal) has nothing to abort, and a
task started, parked and cancelled for it cost 5-10 µs, a cancelled callback ~1.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.types import Receive

from tokenwire.pipeline.errors import ClientGone

T = TypeVar("T")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (and so aborting it) if the client disconnects.

    The only reader of ``receive()`` meanwhile: the body was read before, and the response
    (a stream's ``api.sse.SSEResponse`` watches for the disconnect too) starts after this
    returns.
    ``work`` runs in the caller's task, which the waiter cancels on a disconnect: no second
    task for ``work`` and no ``asyncio.wait`` over both (a fifth of a short request's cost in
    the pipeline, when they were).
    """
    watch = DisconnectWatch(request.receive)
    task = watch.task
    try:
        result = await work
    except BaseException as exc:
        if not watch.gone:
            raise  # a failure, or the server's shutdown
        task.uncancel()  # the cancellation was ours: nothing above may see it pending
        if isinstance(exc, asyncio.CancelledError):
            raise ClientGone("Client disconnected") from None
        raise
    finally:
        watch.stop()
    if watch.gone:  # ``work`` ended anyway; the cancellation it swallowed was ours
        task.uncancel()
        raise ClientGone("Client disconnected")
    return result


class DisconnectWatch:
    """Cancels the calling task when ``receive()`` says the client is gone; the waiter that
    listens is started at the loop's next turn, if ``stop`` has not come first. Its owner
    catches the cancellation, and where ``gone`` says it was this watch's, calls
    ``task.uncancel()``."""

    __slots__ = ("_receive", "_start", "_waiter", "gone", "task")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None, "called from a task"
        self.gone = False
        self.task = task
        self._receive = receive
        self._waiter: asyncio.Task[None] | None = None
        self._start: asyncio.Handle | None = task.get_loop().call_soon(self._begin)

    def stop(self) -> None:
        """No cancellation from here on. Cancelled while parked in ``receive()``, the waiter
        has taken no message."""
        if self._start is not None:
            self._start.cancel()
            self._start = None
        if self._waiter is not None:
            waiter, self._waiter = self._waiter, None
            waiter.cancel()

    def _begin(self) -> None:
        self._start = None
        self._waiter = self.task.get_loop().create_task(_disconnect(self._receive))
        self._waiter.add_done_callback(self._ended)

    def _ended(self, waiter: asyncio.Task[None]) -> None:
        # The waiter may end after ``work`` did (stopped), before this callback ran.
        if waiter is self._waiter and not waiter.cancelled():
            self.gone = True
            self.task.cancel()


async def _disconnect(receive: Receive) -> None:
    """Return at ``http.disconnect``; anything before it (the body replayed by the front
    middleware to a route that parsed it already) is not this waiter's."""
    while (await receive())["type"] != "http.disconnect":
        pass
