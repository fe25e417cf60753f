"""Routes answered without FastAPI's per-request machinery.

For each request FastAPI walks its routes (through every included router), builds scopes,
solves the endpoint's dependencies and reads the body through two more middlewares: ~50 µs of
server CPU, more than tokenising a short prompt, and most of a streamed derender chunk's cost.
An endpoint that takes nothing but its JSON body and the request needs none of it: the front
middleware (``api.asgi``) looks the path up here and calls the endpoint itself, with the body
parsed by orjson and validated by the route's own body field (FastAPI's validator, so the same
values and the same errors). What this path does not handle as FastAPI would (a body that is
not JSON, that orjson refuses but ``json`` takes, a non-JSON content type) goes on to FastAPI,
which answers it as it always has; so does a path not in the table.

Bodies over ``OFFLOAD_BYTES`` are parsed and validated in a worker thread: a derender body of
tens of MB takes a second of parsing and validation that would otherwise stall the event loop
(and every other request, /health included) for as long.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterable
from typing import Any

import orjson
from fastapi import APIRouter
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokenwire.api.errors import exception_response

OFFLOAD_BYTES = 256 * 1024
_JSON_TYPES = frozenset({b"application/json"})


class DirectRoute:
    """One FastAPI route that the front middleware may answer itself."""

    def __init__(self, route: APIRoute) -> None:
        self.route = route
        self.endpoint = route.endpoint
        self.body_field = route.body_field
        self.body_name = route.dependant.body_params[0].name if self.body_field else None
        self.request_name = route.dependant.request_param_name

    @staticmethod
    def eligible(route: APIRoute) -> bool:
        """An endpoint of (at most) one JSON body and the request: nothing FastAPI must solve."""
        dependant = route.dependant
        if (
            "{" in route.path
            or dependant.path_params
            or dependant.query_params
            or dependant.header_params
            or dependant.cookie_params
            or dependant.dependencies
            or len(dependant.body_params) > 1
            or getattr(route, "_embed_body_fields", True)
            or not inspect.iscoroutinefunction(route.endpoint)
        ):
            return False
        named = {dependant.request_param_name, *(field.name for field in dependant.body_params)}
        return set(inspect.signature(route.endpoint).parameters) <= named

    async def answer(self, scope: Scope, receive: Receive, send: Send, body: bytes | None) -> bool:
        """Answer the request; False (nothing sent) to leave it to FastAPI."""
        kwargs: dict[str, Any] = {}
        errors: list[Any] = []
        if self.body_field is not None:
            if body is None or not _json_content(scope):
                return False
            if len(body) > OFFLOAD_BYTES:
                parsed = await asyncio.to_thread(self._parse, body)
            else:
                parsed = self._parse(body)
            if parsed is None:
                return False
            value, errors = parsed
            kwargs[self.body_name] = value  # type: ignore[index]
        scope["route"] = self.route
        scope["endpoint"] = self.endpoint
        scope["path_params"] = {}
        request = Request(scope, receive, send)
        if body is not None:
            request._body = body  # read already; request.body() must not wait for it again
        try:
            if errors:
                raise RequestValidationError(errors, body=body)
            if self.request_name is not None:
                kwargs[self.request_name] = request
            response = await self.endpoint(**kwargs)
        except Exception as exc:
            response = exception_response(request, exc)
            if response is None:
                raise
        if not isinstance(response, Response):
            raise TypeError(f"{self.route.path}: a direct route must return a Response")
        await response(scope, receive, send)
        return True

    def _parse(self, body: bytes) -> tuple[Any, list[Any]] | None:
        """(value, errors) as FastAPI's body field validates it; None if orjson refuses it."""
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        return self.body_field.validate(data, {}, loc=("body",))  # type: ignore[union-attr]


DirectRoutes = dict[tuple[str, str], DirectRoute]


def direct_routes(routers: Iterable[APIRouter]) -> DirectRoutes:
    """(method, path) -> DirectRoute for every eligible route of ``routers`` (no prefixes)."""
    table: DirectRoutes = {}
    for router in routers:
        for route in router.routes:
            if isinstance(route, APIRoute) and DirectRoute.eligible(route):
                direct = DirectRoute(route)
                for method in route.methods:
                    table[(method, route.path)] = direct
    return table


def _json_content(scope: Scope) -> bool:
    """Whether the content type is JSON (FastAPI parses only such bodies as JSON)."""
    for key, value in scope["headers"]:
        if key == b"content-type":
            media_type = value.split(b";", 1)[0].strip().lower()
            return media_type in _JSON_TYPES or (
                media_type.startswith(b"application/") and media_type.endswith(b"+json")
            )
    return False
