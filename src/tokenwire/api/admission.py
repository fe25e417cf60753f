"""Starting a generation request: SGLang's pause holds it until its client leaves.

A held request has started nothing, so a client that gives up (its timeout, a disconnect) is
cancelled here and its place in the bounded queue freed. Checked before waiting, so that a
request starts a disconnect waiter here only while the server holds requests. In a frontend of
``--api-server-count`` the core holds it, while the frontend awaits the job's start: that wait
is watched instead.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

from tokenwire.api.disconnect import unless_disconnected
from tokenwire.pipeline.context import Pipeline

T = TypeVar("T")


async def admitted(request: Request, pipeline: Pipeline, start: Coroutine[Any, Any, T]) -> T:
    """``start`` the request once it may start (``ControlPlane.admit`` may still refuse it)."""
    gate = pipeline.control.gate
    if gate.holding:
        try:
            await unless_disconnected(request, gate.wait_while_held())
        except BaseException:
            start.close()
            raise
    if pipeline.core is not None:
        return await unless_disconnected(request, start)
    return await start
