"""Worker threads for a request's CPU-heavy work (parsing a huge body, rendering its template,
tokenising it) that a shutdown may abandon.

``asyncio.to_thread`` runs work on the loop's default executor, which ``asyncio.run`` joins
before the process may exit (and Python joins every ``ThreadPoolExecutor``'s threads at exit):
SIGTERM during a 20 MB ``/tokenize`` waited for its tokenisation, 39-47 s on a loaded machine.
These threads are daemons nobody joins: a request cancelled at shutdown is answered at once (a
cancelled call that has not started never runs), and work under way dies with the process.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

# As many threads as the default executor has: the work was sized for it.
MAX_THREADS = min(32, (os.cpu_count() or 1) + 4)


class _DaemonPool:
    """A thread pool whose threads are daemons, started as work comes and then kept."""

    def __init__(self, max_threads: int) -> None:
        self._max_threads = max_threads
        self._work: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one per thread waiting for work
        self._lock = threading.Lock()
        self._threads = 0

    def submit(self, work: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._work.put((work, future))
        if self._idle.acquire(blocking=False):
            return future  # a waiting thread takes it
        with self._lock:
            if self._threads < self._max_threads:
                self._threads += 1
                name = f"tokenwire-work-{self._threads}"
                threading.Thread(target=self._run, name=name, daemon=True).start()
        return future

    def _run(self) -> None:
        while True:
            work, future = self._work.get()
            if future.set_running_or_notify_cancel():
                try:
                    result = work()
                except BaseException as exc:  # the caller's to handle
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del work, future  # nothing of a request outlives its work here
            self._idle.release()


_POOL = _DaemonPool(MAX_THREADS)


async def run_abandonable(work: Callable[[], T]) -> T:
    """``work()`` on a daemon worker thread (in the caller's context, as ``to_thread``)."""
    context = contextvars.copy_context()
    return await asyncio.wrap_future(_POOL.submit(lambda: context.run(work)))
