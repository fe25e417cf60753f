"""Admitting a generation request: SGLang's pause holds it until its client leaves.

A held request has started nothing, so a client that gives up (its timeout, a disconnect) is
cancelled here and its place in the bounded queue freed. Checked before waiting, so that a
request starts a disconnect waiter here only while the server holds requests.
"""

from __future__ import annotations

from starlette.requests import Request

from tokenwire.api.disconnect import unless_disconnected
from tokenwire.pipeline.context import Pipeline


async def admitted(request: Request, pipeline: Pipeline) -> None:
    """Return once the request may start (``ControlPlane.admit`` still refuses it after that)."""
    gate = pipeline.control.gate
    if gate.holding:
        await unless_disconnected(request, gate.wait_while_held())
