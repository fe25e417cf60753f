"""A fleet: two tokenwire servers behind vllm-router (PyPI ``vllm-router``, a real router binary).

``consistent_hash`` keys on ``X-Session-ID``: every request of one session must land on one
server, and render -> generate -> derender must work through the router. ``power_of_two`` picks
by the load each server reports on ``GET /get_load``. The servers are the session's two SmolLM2
servers, one with keys as README "Scale out" sets them: the router holds a key of its own
(``--router-api-key``), which opens the stateless routes only; generating routes take the client's
key, which the router forwards on them. Behind the router no control route answers (the servers'
control key is one the router does not hold), and neither do the session-recording dialects.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import API_KEY, CONTROL_KEY, ROUTER_KEY, Server, free_port

ROUTER_START_TIMEOUT_S = 60
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def route_count(server: Server, route: str) -> float:
    """How many requests ``server`` answered on ``route``, from its Prometheus counters."""
    text = server.client().get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("tokenwire_requests_total{") and f'route="{route}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


class Router:
    """A ``vllm-router`` subprocess in front of ``servers``."""

    def __init__(self, servers: list[Server], policy: str, log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        binary = Path(sys.executable).parent / "vllm-router"
        command = [
            str(binary),
            "--host",
            "127.0.0.1",
            "--port",
            self.url.rsplit(":", 1)[1],
            "--policy",
            policy,
            "--worker-urls",
            *(s.url for s in servers),
            "--log-level",
            "warning",
            "--prometheus-port",
            str(free_port()),
            # Sent to the workers as their bearer key on the routes where it does not forward
            # the client's headers (all but the generating ones and /v1/models).
            "--api-key",
            ROUTER_KEY,
        ]
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.log_path = log_path
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm-router did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def client(self, session_id: str, *, keep_alive: bool = True) -> httpx.Client:
        headers = {"Authorization": f"Bearer {API_KEY}", "X-Session-ID": session_id}
        limits = httpx.Limits(max_keepalive_connections=None if keep_alive else 0)
        return httpx.Client(base_url=self.url, headers=headers, timeout=120, limits=limits)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


@pytest.fixture(scope="module")
def fleet(smollm2_server: Server, rl_server: Server) -> list[Server]:
    return [smollm2_server, rl_server]


@pytest.fixture(scope="module")
def hash_router(fleet: list[Server], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    router = Router(fleet, "consistent_hash", tmp_path_factory.mktemp("router") / "router.log")
    yield router
    router.stop()


def one_turn(client: httpx.Client) -> str:
    """render -> generate -> derender through the router; returns the content."""
    render = client.post("/v1/chat/completions/render", json={"messages": PARIS, "max_tokens": 8})
    assert render.status_code == 200, render.text
    generate_request = render.json()
    generate_request["sampling_params"]["temperature"] = 0
    generated = client.post("/inference/v1/generate", json=generate_request)
    assert generated.status_code == 200, generated.text
    derendered = client.post(
        "/v1/chat/completions/derender", json={"generate_response": generated.json()}
    )
    assert derendered.status_code == 200, derendered.text
    return derendered.json()["choices"][0]["message"]["content"]


def placement(router: Router, fleet: list[Server], session: str, route: str, turn) -> int:
    """Which server of ``fleet`` answered every one of a session's turns on ``route``."""
    before = [route_count(s, route) for s in fleet]
    with router.client(session) as client:
        turns = turn(client)
    served = [route_count(s, route) - b for s, b in zip(fleet, before, strict=True)]
    assert sorted(served) == [0, turns], (session, served)  # all on one server
    return served.index(turns)


def tokenize_twice(client: httpx.Client) -> int:
    for _ in range(2):
        assert client.post("/tokenize", json={"prompt": "Hello"}).status_code == 200
    return 2


def two_turns(client: httpx.Client) -> int:
    for _ in range(2):
        assert "Paris" in one_turn(client)
    return 2


def test_a_session_stays_on_one_server(hash_router: Router, fleet: list[Server]) -> None:
    # Sixteen sessions (cheap requests): each sticks to one server, and both servers get some.
    where = {
        f"s{i}": placement(hash_router, fleet, f"s{i}", "/tokenize", tokenize_twice)
        for i in range(16)
    }
    assert set(where.values()) == {0, 1}
    # render -> generate -> derender through the router, on the session's server.
    for session in ("s0", "s1"):
        assert (
            placement(hash_router, fleet, session, "/inference/v1/generate", two_turns)
            == (where[session])
        )


def test_power_of_two_balances_on_reported_load(
    fleet: list[Server], tmp_path_factory: pytest.TempPathFactory
) -> None:
    polled = sum(route_count(s, "/get_load") for s in fleet)
    router = Router(fleet, "power_of_two", tmp_path_factory.mktemp("p2") / "router.log")
    try:
        with router.client("any") as client:
            two_turns(client)
    finally:
        router.stop()
    assert sum(route_count(s, "/get_load") for s in fleet) > polled


def test_no_control_route_answers_through_the_router(
    control_server: Server, tmp_path_factory: pytest.TempPathFactory
) -> None:
    trainer = {"Authorization": f"Bearer {CONTROL_KEY}"}
    with httpx.Client(base_url=control_server.url, headers=trainer, timeout=120) as direct:
        paths = direct.get("/openapi.json").json()["paths"]
        version = direct.get("/weight_info").json()["weight_version"]
    operations = sorted(
        (method.upper(), path)
        for path, item in paths.items()
        for method, operation in item.items()
        if "control" in operation.get("tags", ())
    )
    assert len(operations) >= 20, operations
    # Bodies that would act, were they let through; and abort-all on the inference routes.
    body = {"weight_dir": "/nonexistent", "model_path": "/nonexistent", "new_version": "v9"}
    calls = [(method, path, body) for method, path in operations]
    calls += [("POST", "/abort_requests", {}), ("POST", "/abort_request", {"abort_all": True})]
    router = Router([control_server], "consistent_hash", tmp_path_factory.mktemp("r") / "log")
    try:
        # A connection each: the router may close one after refusing a request whose body it
        # did not read, and a request already sent on it then races that close.
        with router.client("any", keep_alive=False) as client:
            answered = {}
            for method, path, payload in calls:
                # A client sending the control key itself: the router forwards its own key.
                for headers in (None, trainer):
                    response = client.request(method, path, json=payload, headers=headers)
                    if response.is_success:
                        answered[(method, path)] = response.text[:200]
            assert answered == {}
            # The session dialects and trajectory reads: the router's key opens none of them.
            for path in ("/v1/responses", "/v1/messages", "/v1/sessions", "/v1/sessions/any"):
                body = {"input": "Hi", "max_tokens": 4, "messages": PARIS}
                answer = client.get(path) if "sessions" in path else client.post(path, json=body)
                assert answer.status_code == 401, (path, answer.text)
            # Inference through the router is as it was.
            assert "Paris" in one_turn(client)
            # Aborting by id is not the router key's either (a client ends its own request by
            # closing its connection, which the router passes on).
            assert client.post("/abort_requests", json={"request_ids": ["x"]}).status_code == 401
    finally:
        router.stop()
    with httpx.Client(base_url=control_server.url, headers=trainer, timeout=120) as direct:
        assert direct.get("/is_paused").json() == {"is_paused": False}
        assert direct.get("/weight_info").json()["weight_version"] == version
        assert direct.post("/pause").json() == {"status": "paused"}  # the trainer, directly
        assert direct.post("/resume").json() == {"status": "resumed"}
