"""Disconnects over a real socket: the real app and protocol on uvicorn, over the fake engine.

A request waiting on the engine has one waiter parked in ``receive()`` (no polling timer): a
client that closes its connection must still end its engine requests, streamed or not, and a
request that is answered must leave its keep-alive connection usable for the next one.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import orjson
import pytest
import uvicorn
from fastapi import FastAPI

from tests.conftest import free_port
from tests.fake_engine import FakeEngine, Gate, Step
from tests.fast_app import weightless_view
from tokenwire.api.app import create_app
from tokenwire.api.server import uvicorn_config
from tokenwire.assets import prepare
from tokenwire.settings import DEFAULT_MODEL, parse_serve_args

GENERATE = "/inference/v1/generate"
EOS = 2  # SmolLM2's <|im_end|>


@dataclass
class Served:
    engine: FakeEngine
    port: int
    app: FastAPI

    def jobs_left(self) -> int:
        return len(self.app.state.pipeline.jobs)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    view = weightless_view(prepare(DEFAULT_MODEL), tmp_path_factory.mktemp("weightless"))
    port = free_port()
    settings = parse_serve_args(
        ["--model", str(view), "--port", str(port), "--log-level", "critical"]
    )
    engine = FakeEngine.for_model(view)
    app = create_app(settings, engine)
    server = uvicorn.Server(uvicorn_config(app, settings))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started or httpx.get(f"http://127.0.0.1:{port}/health").is_error:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        yield Served(engine, port, app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [False, True])
def test_a_closed_connection_ends_its_engine_requests(served: Served, stream: bool) -> None:
    gate = Gate()  # never opened: the engine answers nothing until the client leaves
    served.engine.script = lambda *_: [5, Step(6, gate=gate), EOS]
    payload = orjson.dumps({"token_ids": [1, 2], "sampling_params": {"n": 2}, "stream": stream})
    client = socket.create_connection(("127.0.0.1", served.port), timeout=10)
    client.sendall(
        b"POST " + GENERATE.encode() + b" HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    gate.wait_reached()
    if stream:
        assert client.recv(12) == b"HTTP/1.1 200"
    wait_until(lambda: len(served.engine.live) == 2)
    client.close()
    wait_until(lambda: not served.engine.live and not served.jobs_left())
    assert all(call.finish_reason != "stop" for call in served.engine.calls[-2:])


def test_answered_requests_keep_their_connection(served: Served) -> None:
    """The waiter is cancelled when the answer is ready: the next request on the same
    keep-alive connection is read and answered, not taken for a disconnect."""
    served.engine.script = lambda *_: [7, 8, EOS]
    body = {"token_ids": [1, 2], "sampling_params": {}}
    with httpx.Client(base_url=f"http://127.0.0.1:{served.port}", timeout=10) as client:
        for _ in range(3):
            response = client.post(GENERATE, json=body)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["token_ids"] == [7, 8, EOS]
        assert client.get("/health").status_code == 200
