"""Routes answered without FastAPI's per-request machinery.

For each request FastAPI walks its routes (through every included router), builds scopes,
solves the endpoint's dependencies and reads the body through two more middlewares: ~50 µs of
server CPU, more than tokenising a short prompt, and most of a streamed derender chunk's cost.
An endpoint that takes nothing but its JSON body and the request needs none of it: the front
middleware (``api.asgi``) looks the path up here and calls the endpoint itself, with the body
parsed by pydantic-core's JSON parser and validated by the route's own body field (FastAPI's
validator, so the same values and the same errors). The parser reads what it takes as FastAPI's
``json.loads`` does (integers of any size exactly, ``1e400`` as infinity, the last of repeated
keys) and refuses more: NaN and Infinity, a UTF-8 BOM, UTF-8-encoded surrogates, and nesting
deeper than 200 levels (``json`` stops at about 1000 less the stack in use). What it refuses goes
on to FastAPI, which answers it as it always has; so does a content type FastAPI does not read
as JSON (or none), and a path not in the table.
``tests/test_direct_routes.py`` sends the same requests to the app with and without this path,
on every route it takes, and asserts the same status, headers and body.

What this reads of FastAPI's internals, once per route at start-up and nowhere else
(``_fastapi_view``): the route's ``dependant`` (what FastAPI would solve per request), its
private ``_embed_body_fields``, and its ``body_field`` with ``validate(value, values, loc=)``.
Where an upgrade removed or reshaped any of them the route is left to FastAPI, with a warning:
slower, never broken.

Bodies over ``OFFLOAD_BYTES`` are parsed and validated in a worker thread: a derender body of
tens of MB takes a second of parsing and validation that would otherwise stall the event loop
(and every other request, /health included) for as long. The thread is one a shutdown does not
wait for (``abandonable``).
"""

from __future__ import annotations

import inspect
import logging
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pydantic_core
from fastapi import APIRouter, params
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import Receive, Scope, Send

from tokenwire.abandonable import run_abandonable
from tokenwire.api.errors import exception_response

logger = logging.getLogger("tokenwire.api")

OFFLOAD_BYTES = 256 * 1024
# Methods whose body the front middleware does not read.
NO_BODY_METHODS = frozenset({"GET", "HEAD"})

Validate = Callable[[Any], tuple[Any, list[Any]]]


@dataclass(frozen=True)
class _FastAPIView:
    """What FastAPI knows of an eligible endpoint: its parameter names and body validator."""

    body_name: str | None
    request_name: str | None
    validate: Validate | None


class DirectRoute:
    """One FastAPI route that the front middleware may answer itself."""

    def __init__(self, route: APIRoute, view: _FastAPIView) -> None:
        self.route = route
        self.endpoint = route.endpoint
        self.body_name = view.body_name
        self.request_name = view.request_name
        self.validate = view.validate

    async def answer(self, scope: Scope, receive: Receive, send: Send, body: bytes | None) -> bool:
        """Answer the request; False (nothing sent, nothing received) to leave it to FastAPI.
        ``receive`` gives ``body`` (read already by the front) again first."""
        kwargs: dict[str, Any] = {}
        errors: list[Any] = []
        if self.validate is not None:
            if body is None or not _json_content(scope):
                return False
            if len(body) > OFFLOAD_BYTES:
                parsed = await run_abandonable(lambda: self._parse(body))
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
        await response(scope, receive, send)
        return True

    def _parse(self, body: bytes) -> tuple[Any, list[Any]] | None:
        """(value, errors) as FastAPI's body field validates it; None if the parser refuses it."""
        try:
            # Not orjson (as fast): it reads integers past 64 bits as floats, nests 1024 deep.
            data = pydantic_core.from_json(body, allow_inf_nan=False)
        except ValueError:
            return None
        return self.validate(data)  # type: ignore[misc]


DirectRoutes = dict[tuple[str, str], DirectRoute]


def direct_routes(routers: Iterable[APIRouter]) -> DirectRoutes:
    """(method, path) -> DirectRoute for the eligible routes of ``routers``, included in this
    order with no prefix and no dependencies; a route that an earlier one shadows (a path
    parameter, the same path twice) is left to FastAPI, which would not pick it."""
    routes = [route for router in routers for route in router.routes]
    table: DirectRoutes = {}
    for route in routes:
        if not isinstance(route, APIRoute):
            continue
        view = _fastapi_view(route)
        if view is None:
            continue
        direct = DirectRoute(route, view)
        for method in route.methods:
            if method in NO_BODY_METHODS and direct.validate is not None:
                continue  # the front reads no body for these: FastAPI answers them
            if _first_match(routes, method, route.path) is route:
                table[(method, route.path)] = direct
    return table


def _fastapi_view(route: APIRoute) -> _FastAPIView | None:
    """The view of an endpoint of (at most) one JSON body and the request that returns a
    Response; None for any other endpoint, or where FastAPI's internals are not as expected."""
    try:
        dependant = route.dependant
        if (
            "{" in route.path
            or dependant.path_params
            or dependant.query_params
            or dependant.header_params
            or dependant.cookie_params
            or dependant.dependencies
            or len(dependant.body_params) > 1
            or route._embed_body_fields
            or not inspect.iscoroutinefunction(route.endpoint)
            or not _returns_response(route.endpoint)
        ):
            return None
        request_name = dependant.request_param_name
        body_name = dependant.body_params[0].name if dependant.body_params else None
        named = {request_name, body_name}
        if not set(inspect.signature(route.endpoint).parameters) <= named:
            return None  # a parameter FastAPI fills otherwise (BackgroundTasks, Response...)
        if body_name is not None and isinstance(route.body_field.field_info, params.Form):
            return None  # FastAPI reads a form
        validate = None if body_name is None else _validator(route.body_field)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
        logger.warning("%s is left to FastAPI: its internals changed (%r)", route.path, exc)
        return None
    return _FastAPIView(body_name, request_name, validate)


def _validator(field: Any) -> Validate:
    """The body field's validator, checked to answer as FastAPI's own call expects."""

    def validate(data: Any) -> tuple[Any, list[Any]]:
        return field.validate(data, {}, loc=("body",))

    # A JSON null (which a client may send): a result of FastAPI's shape, or no fast path.
    _, errors = validate(None)
    if not isinstance(errors, list) or any(error["loc"][:1] != ("body",) for error in errors):
        raise TypeError(f"unexpected validation result {errors!r}")
    return validate


def _returns_response(endpoint: Callable[..., Any]) -> bool:
    """Whether the endpoint returns a Response (else FastAPI serialises what it returns)."""
    try:
        annotation = typing.get_type_hints(endpoint).get("return")
    except NameError:  # an annotation that does not resolve: FastAPI decides
        return False
    return isinstance(annotation, type) and issubclass(annotation, Response)


def _first_match(routes: list[BaseRoute], method: str, path: str) -> BaseRoute | None:
    """The route that Starlette's routing picks for ``method`` and ``path``."""
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route
    return None


def _json_content(scope: Scope) -> bool:
    """Whether FastAPI parses the body as JSON: a content type of ``application/json`` or
    ``application/*+json``, read as its ``email.message`` does (anything else: ``text/plain``)."""
    for key, value in scope["headers"]:
        if key == b"content-type":
            media_type = value.split(b";", 1)[0].strip().lower()
            if media_type.count(b"/") != 1:
                return False
            main, sub = media_type.split(b"/")
            return main == b"application" and (sub == b"json" or sub.endswith(b"+json"))
    return False  # FastAPI reads a body with no content type as bytes (strict_content_type)
