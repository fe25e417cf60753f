"""Coarse deadlines for many short waits that almost never expire.

``asyncio.timeout`` arms an event-loop timer per wait and cancels it after: about 12 µs with
uvloop, a tenth of a short request's CPU, to guard the read of a body that has nearly always
arrived with the headers. Here a wait costs a dict entry: one timer ticks every ``resolution``
seconds while waits are pending (re-armed at most once per tick however many requests come),
and a wait past its deadline is cancelled at the next tick, so up to ``resolution`` late.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class Deadlines:
    """Deadlines of the waits of one event loop at a time (a server's; in tests, a client's
    loop after another's: a new loop drops the waits of the previous one)."""

    def __init__(self, resolution: float) -> None:
        self.resolution = resolution
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[Wait, float] = {}  # wait -> its deadline (loop time)
        self._timer: asyncio.TimerHandle | None = None

    def within(self, seconds: float) -> Wait:
        """``with deadlines.within(s):`` raises ``TimeoutError`` if its body, awaiting in the
        current task, is still running ``s`` seconds later (as ``asyncio.timeout`` does)."""
        return Wait(self, seconds)

    def _add(self, wait: Wait, seconds: float) -> None:
        loop = wait.task.get_loop()
        if loop is not self._loop:
            self._loop, self._pending, self._timer = loop, {}, None
        self._pending[wait] = loop.time() + seconds
        if self._timer is None:
            self._timer = loop.call_later(self.resolution, self._tick)

    def _remove(self, wait: Wait) -> None:
        self._pending.pop(wait, None)

    def _tick(self) -> None:
        self._timer = None
        loop = self._loop
        if loop is None or not self._pending:
            return  # idle: the next wait arms the timer again
        now = loop.time()
        for wait, deadline in list(self._pending.items()):
            if deadline <= now:
                del self._pending[wait]
                wait.expire()
        if self._pending:
            self._timer = loop.call_later(self.resolution, self._tick)


class Wait:
    """One wait of ``Deadlines``: a context manager around awaits in one task."""

    __slots__ = ("_cancelling", "_deadlines", "_seconds", "expired", "task")

    def __init__(self, deadlines: Deadlines, seconds: float) -> None:
        self._deadlines = deadlines
        self._seconds = seconds
        self.expired = False

    def __enter__(self) -> Wait:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a deadline is for awaits in a task")
        self.task = task
        self._cancelling = task.cancelling()
        self._deadlines._add(self, self._seconds)
        return self

    def expire(self) -> None:
        self.expired = True
        self.task.cancel()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._deadlines._remove(self)
        # As asyncio.timeout: our cancellation, not one from elsewhere, becomes the timeout.
        expired = self.expired and self.task.uncancel() <= self._cancelling
        if expired and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc
