"""Control apart from inference: which routes need the control key, and who holds it.

A route that changes the server (weights, pause, sleep, versions, caches, ...) or reads what
only its operator should (``/metrics``) needs ``--control-api-key``: a key the trainer holds and
a router in front of the servers never does, so no router client can reach these routes. Unset,
it is ``--api-key``, which is unsafe behind a router: the router sends that key with everything
it forwards, control routes included.

vllm-router forwards a client's own headers (its key, ``X-Session-ID``) only on the routes it
knows (OpenAI chat and completions, generate, models); on any other route it sends its own
``--api-key`` and nothing of the client's. ``--router-api-key`` names that key: it opens only
the routes tagged ``STATELESS``, so through the router nothing that generates or reads sessions
answers without a client's key.

A route opts in with one tag, ``tags=[CONTROL]``, on its router (every route of
``routes.control``) or on the route itself; nothing else is registered anywhere. The front
middleware (``api.asgi``) reads the tags once at start-up and checks the key before the body is
read. A route where the body decides (``/abort_requests`` without ids aborts every client's
requests) calls ``require_control_key`` once it has read it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from starlette.requests import Request
from starlette.routing import BaseRoute, Route

from tokenwire.api.errors import APIError

CONTROL = "control"
# Routes that compute from their body alone (render, extend, derender, tokenize, the model
# list): no generation, no session, no server state. The only routes the router's key opens.
STATELESS = "stateless"
# The scope key where the front middleware says whether the request holds the control key.
HOLDS_CONTROL_KEY = "tokenwire.holds_control_key"
# The scope key where it puts the credential the request holds (bytes, None without one): the
# owner of the sessions it writes (``pipeline.sessions``), kept as a hash only.
CREDENTIAL = "tokenwire.credential"
CONTROL_KEY_MISSING = (
    "Missing or invalid API key: this route needs the control key (--control-api-key)"
)
ROUTER_KEY_REFUSED = (
    "Missing or invalid API key: the router's key (--router-api-key) opens only the stateless "
    "routes (render, extend, derender, tokenize); this one needs a client's own --api-key"
)


class TaggedRoutes:
    """The (method, path) pairs of the routes tagged ``tag``, path parameters included."""

    def __init__(self, routes: Iterable[BaseRoute], tag: str = CONTROL) -> None:
        self._exact: set[tuple[str, str]] = set()
        self._patterns: list[tuple[frozenset[str], re.Pattern[str]]] = []
        for route in routes:
            if not isinstance(route, Route) or tag not in (getattr(route, "tags", None) or ()):
                continue
            methods = frozenset(route.methods or ())
            if "{" in route.path:
                self._patterns.append((methods, route.path_regex))
            else:
                self._exact.update((method, route.path) for method in methods)

    def need_key(self, method: str, path: str) -> bool:
        if (method, path) in self._exact:
            return True
        return any(method in methods and regex.match(path) for methods, regex in self._patterns)


def require_control_key(request: Request) -> None:
    """A 401 unless the request holds the control key (or the server has none)."""
    if not request.scope.get(HOLDS_CONTROL_KEY, False):
        raise APIError(401, CONTROL_KEY_MISSING)
