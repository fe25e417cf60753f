"""Fast apps: the real tokenwire app over a scripted ``FakeEngine``, run in process.

Everything but the engine is what ``tokenwire serve`` builds from the same flags (tokenizer,
chat template, token table, parsers, middleware, routes), so tests on it cover the job, stop
handling, weight versions, the dialects' formatting and the control plane in milliseconds per
request (``fast_*`` fixtures in conftest). Each app is built from a view of the model directory
without its weight files: if anything tried to load weights, the app would not come up.

Starlette's TestClient runs the app on an event-loop thread of its own and streams responses as
they are sent (closing one early cancels it, as a client disconnect does), so a test may drive
several requests from threads and interleave them with the fake engine's gates.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.testclient import TestClient

from tests.fake_engine import FakeEngine
from tokenwire.api.app import create_app
from tokenwire.assets import prepare
from tokenwire.settings import DEFAULT_MODEL, parse_serve_args

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
_READY_TIMEOUT_S = 60


@dataclass
class FastApp:
    """One app over its fake engine; ``client`` carries the app's API key, if any."""

    client: TestClient
    engine: FakeEngine
    rl_control: bool
    model_dir: Path  # what a checkpoint reload may name (the fake loads nothing from it)

    def tokenize(self, text: str) -> list[int]:
        """``text`` as the model's tokenizer encodes it (no special tokens added)."""
        response = self.client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    def wait_until(self, condition: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, "condition never held"
            time.sleep(0.005)

    def post_then_disconnect(
        self, path: str, body: dict[str, Any], disconnect: threading.Event
    ) -> Future[list[dict[str, Any]]]:
        """POST ``body`` as a client that goes away once ``disconnect`` is set (TestClient
        cannot: its request only ends with the response). A future of the ASGI messages sent."""
        sent: list[dict[str, Any]] = []
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), *self._auth_header()],
            "client": ("127.0.0.1", 1),
            "server": ("testserver", 80),
        }
        payload = orjson.dumps(body)
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": payload, "more_body": False}
            while not disconnect.is_set():
                await asyncio.sleep(0.005)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def call() -> list[dict[str, Any]]:
            await self.client.app(scope, receive, send)
            return sent

        assert self.client.portal is not None
        return self.client.portal.start_task_soon(call)

    def abort_all(self) -> int:
        """Abort every job still registered; how many there were (0: nothing runs)."""
        response = self.client.post("/abort_requests", json={})
        assert response.status_code == 200, response.text
        return response.json()["aborted"]

    def settle(self) -> None:
        """End what a test left running and put the app back as it started."""
        for call in list(self.engine.live.values()):
            call.aborted = True
        self.wait_until(lambda: not self.engine.live)
        if self.rl_control:
            self._settle_control()
        self.engine.reset()

    def _settle_control(self) -> None:
        """No update open, weights whole, no group, no adapter, not paused."""
        self.engine.receive_gate = None
        # An update with tensors in ends at its deadline (resume does not end it).
        self.wait_until(lambda: self.client.get("/weight_info").json()["state"] != "updating")
        resumed = self.client.post("/resume")
        if resumed.status_code != 200:  # broken weights: a checkpoint reload mends them
            reload = {"weight_dir": str(self.model_dir)}
            assert self.client.post("/update_weights", json=reload).status_code == 200
            resumed = self.client.post("/resume")
        assert resumed.status_code == 200, resumed.text
        assert self.client.post("/shutdown_weight_transfer_engine").status_code == 200
        models = self.client.get("/v1/models").json()["data"]
        for adapter in (m["id"] for m in models if m["parent"] is not None):
            body = {"lora_name": adapter}
            assert self.client.post("/v1/unload_lora_adapter", json=body).status_code == 200

    def _auth_header(self) -> list[tuple[bytes, bytes]]:
        auth = self.client.headers.get("authorization")
        return [(b"authorization", auth.encode())] if auth else []


def weightless_view(model_dir: Path, into: Path) -> Path:
    """``model_dir``'s files but its weights, as symlinks (the name stays the asset's)."""
    view = into / model_dir.name
    view.mkdir()
    for file in model_dir.iterdir():
        if not file.name.endswith(_WEIGHT_SUFFIXES):
            (view / file.name).symlink_to(file)
    return view


def serve_fast(
    tmp_path_factory: pytest.TempPathFactory, args: list[str], api_key: str | None = None
) -> Iterator[FastApp]:
    """The app ``tokenwire serve ARGS`` builds (a test server's flags), over a fake engine."""
    model = DEFAULT_MODEL
    if "--model" in args:
        at = args.index("--model")
        model, args = args[at + 1], args[:at] + args[at + 2 :]
    view = weightless_view(prepare(model), tmp_path_factory.mktemp("weightless"))
    if "--served-model-name" not in args:
        args = [*args, "--served-model-name", model]
    argv = [*args, "--model", str(view)]
    if "--session-store" not in argv:  # its own, not the one in the user's cache
        argv += ["--session-store", str(view.parent / "sessions.sqlite3")]
    if api_key:
        argv += ["--api-key", api_key]
    settings = parse_serve_args(argv)
    engine = FakeEngine.for_model(view, max_model_len=settings.max_model_len)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with TestClient(create_app(settings, engine), headers=headers) as client:
        app = FastApp(client, engine, rl_control=settings.enable_rl_control, model_dir=view)
        app.wait_until(lambda: client.get("/health").status_code == 200, _READY_TIMEOUT_S)
        yield app


def sse_chunks(client: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed POST's events, parsed; checks the framing and the closing ``[DONE]``."""
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    frames = raw.split("\n\n")[:-2]
    assert all(frame.startswith("data: ") for frame in frames)
    return [orjson.loads(frame.removeprefix("data: ")) for frame in frames]


def fast_client(app_fixture: str, name: str) -> Any:
    """A fixture ``name`` that is ``app_fixture``'s client: a module that needs no model forward
    serves the server fixture it names from the same server's app over the fake engine, which
    makes its tests part of ``make test-fast``."""

    @pytest.fixture(scope="session", name=name)
    def client(request: pytest.FixtureRequest) -> TestClient:
        return request.getfixturevalue(app_fixture).client

    return client


def without_ids(answer: Any) -> Any:
    """``answer`` without what differs between two equal answers: ids and times."""
    if isinstance(answer, dict):
        return {
            k: without_ids(v)
            for k, v in answer.items()
            if k not in ("id", "request_id", "created", "created_at", "item_id")
        }
    if isinstance(answer, list):
        return [without_ids(item) for item in answer]
    return answer
