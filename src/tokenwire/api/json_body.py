"""Routes whose JSON bodies are parsed with orjson (derender bodies run to tens of MB).

FastAPI parses bodies with the stdlib ``json``, 2-4x slower than orjson on large bodies. orjson
refuses a few things ``json`` takes (NaN and Infinity literals, integers beyond 64 bits; lone
surrogates never get here, ``RequestBodyMiddleware`` refuses them); such bodies go to ``json``,
so a route accepts and refuses what it did before.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response


class OrjsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = orjson.loads(body)
            except orjson.JSONDecodeError:
                self._json = json.loads(body)  # its JSONDecodeError is FastAPI's 400
        return self._json


class OrjsonRoute(APIRoute):
    """An ``APIRoute`` whose handler reads the body through ``OrjsonRequest``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(OrjsonRequest(request.scope, request.receive))

        return route
