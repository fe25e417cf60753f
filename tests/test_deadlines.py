"""``api.deadlines``: coarse deadlines behave as ``asyncio.timeout`` does, a tick late at most."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from tokenwire.api.deadlines import Deadlines

RESOLUTION = 0.02


def run(coroutine_function: Callable[[], Coroutine[Any, Any, None]]) -> None:
    uvloop.run(coroutine_function())


def test_a_wait_past_its_deadline_raises_timeout_error_within_a_tick() -> None:
    async def main() -> None:
        deadlines = Deadlines(RESOLUTION)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError), deadlines.within(0.05):
            await asyncio.sleep(10)
        waited = loop.time() - started
        assert 0.05 <= waited < 0.05 + 2 * RESOLUTION + 0.05
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        await asyncio.sleep(0)  # not cancelled again

    run(main)


def test_waits_that_end_in_time_are_left_alone_and_the_timer_stops() -> None:
    async def main() -> None:
        deadlines = Deadlines(RESOLUTION)
        for _ in range(100):
            with deadlines.within(0.05):
                await asyncio.sleep(0)
        await asyncio.sleep(0.1)  # past every deadline: nothing pending, nothing cancelled
        assert deadlines._timer is None and not deadlines._pending

    run(main)


def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    async def waiting(deadlines: Deadlines) -> None:
        with deadlines.within(10):
            await asyncio.sleep(10)

    async def main() -> None:
        deadlines = Deadlines(RESOLUTION)
        task = asyncio.create_task(waiting(deadlines))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not deadlines._pending

    run(main)


def test_a_new_event_loop_starts_afresh() -> None:
    deadlines = Deadlines(RESOLUTION)

    async def main() -> None:
        with pytest.raises(TimeoutError), deadlines.within(0.03):
            await asyncio.sleep(10)

    run(main)
    run(main)  # a test client's loop after another's
