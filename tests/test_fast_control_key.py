"""Control apart from inference: routes that change the server take the control key only.

A server with ``--api-key`` (what a router in front holds and forwards) and ``--control-api-key``
(what only the trainer holds): every route tagged ``CONTROL`` refuses the inference key, and
abort-all (``/abort_requests`` without ids, SGLang's ``abort_all``) does too; inference routes
take either key. ``tests/test_router.py`` checks the same through a real vllm-router.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import APIRouter
from starlette.testclient import TestClient

from tests.conftest import RL_SERVER_ARGS
from tests.fake_engine import Gate, Step
from tests.fast_app import FastApp, serve_fast, sse_chunks
from tokenwire.api.control_key import CONTROL, TaggedRoutes

INFERENCE_KEY = "inference-key"
CONTROL_KEY = "control-key"
CONTROL_AUTH = {"Authorization": f"Bearer {CONTROL_KEY}"}
PROMPT = [504, 3458, 314, 4649]
# What the red team reached through a router with the servers' key (issue 22), at least.
MUST_BE_CONTROL = {
    ("POST", "/update_weights"),
    ("POST", "/update_weights_from_disk"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("POST", "/update_weight_version"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/flush_cache"),
    ("POST", "/pause_generation"),
    ("POST", "/release_memory_occupation"),
    ("GET", "/metrics"),
    # The frameworks' own routes.
    ("POST", "/collective_rpc"),
    ("POST", "/fetch_weights"),
    ("POST", "/init_weight_update_communicator"),
    ("POST", "/areal_pause_generation"),
    ("POST", "/areal_continue_generation"),
    ("POST", "/areal_update_weights"),
    ("POST", "/areal_init_weights_update_group"),
    ("POST", "/areal_set_update_weight_meta"),
    ("POST", "/areal_update_weights_xccl"),
    ("POST", "/areal_set_update_weight_meta_lora"),
    ("POST", "/areal_update_weights_lora_xccl"),
}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastApp]:
    """The RL server's app with both keys; its client sends the inference key."""
    args = [*RL_SERVER_ARGS, "--control-api-key", CONTROL_KEY]
    yield from serve_fast(tmp_path_factory, args, INFERENCE_KEY)


def control_operations(fast: FastApp) -> list[tuple[str, str]]:
    """The operations FastAPI itself tags ``CONTROL`` (its OpenAPI document)."""
    paths = fast.client.get("/openapi.json").json()["paths"]
    return sorted(
        (method.upper(), path)
        for path, operations in paths.items()
        for method, operation in operations.items()
        if CONTROL in operation.get("tags", ())
    )


def test_control_routes_refuse_the_inference_key(keyed: FastApp) -> None:
    operations = control_operations(keyed)
    assert set(operations) >= MUST_BE_CONTROL, MUST_BE_CONTROL - set(operations)
    # A body that would load weights, were the key right: refused before it is read.
    body = {"weight_dir": "/nonexistent", "model_path": "/nonexistent", "new_version": "v9"}
    unkeyed = TestClient(keyed.client.app)  # no Authorization header at all
    for method, path in operations:
        for client, headers in (
            (unkeyed, None),
            (keyed.client, {"Authorization": "Bearer wrong"}),
            (keyed.client, None),  # the inference key, as a router sends it
        ):
            response = client.request(method, path, json=body, headers=headers)
            assert response.status_code == 401, (method, path, headers, response.text)
            assert "control key" in response.json()["error"]["message"]
    assert keyed.engine.weight_version == "default"
    assert not keyed.engine.paused


def test_the_control_key_opens_them_and_inference_too(keyed: FastApp) -> None:
    client = keyed.client
    assert client.post("/pause", headers=CONTROL_AUTH).json() == {"status": "paused"}
    assert client.get("/is_paused", headers=CONTROL_AUTH).json() == {"is_paused": True}
    assert client.post("/resume", headers=CONTROL_AUTH).status_code == 200
    assert "tokenwire_requests_total" in client.get("/metrics", headers=CONTROL_AUTH).text
    # Inference takes either key, nothing else.
    for headers in (None, CONTROL_AUTH):
        assert client.post("/tokenize", json={"prompt": "Hi"}, headers=headers).status_code == 200
    assert client.get("/get_load").status_code == 200  # what a router polls
    unkeyed = TestClient(client.app)
    for response in (
        unkeyed.post("/tokenize", json={"prompt": "Hi"}),
        client.post("/tokenize", json={"prompt": "Hi"}, headers={"Authorization": "Bearer wrong"}),
    ):
        assert response.status_code == 401, response.text
        assert response.json()["error"]["message"] == "Missing or invalid API key"
    assert unkeyed.get("/health").status_code == 200


@pytest.mark.parametrize(
    ("path", "abort_all", "by_id"),
    [
        ("/abort_requests", {}, {"request_ids": ["nothing-running"]}),
        ("/abort_requests", {"request_ids": []}, {"request_ids": ["nothing-running"]}),
        ("/abort_request", {"abort_all": True}, {"rid": "nothing-running"}),
    ],
)
def test_abort_all_needs_the_control_key(
    keyed: FastApp, path: str, abort_all: dict[str, Any], by_id: dict[str, Any]
) -> None:
    gate = Gate()
    keyed.engine.script = lambda *_: [5, Step(6, gate=gate), 2]
    body = {"token_ids": PROMPT, "sampling_params": {}, "stream": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reading = pool.submit(sse_chunks, keyed.client, "/inference/v1/generate", body)
        gate.wait_reached()
        refused = keyed.client.post(path, json=abort_all)
        assert refused.status_code == 401, refused.text
        assert "control key" in refused.json()["error"]["message"]
        assert keyed.client.post(path, json=by_id).status_code == 200  # by id: any client
        assert keyed.engine.live  # still running
        assert keyed.client.post(path, json=abort_all, headers=CONTROL_AUTH).status_code == 200
        finish = [c for c in reading.result(timeout=10) if c["choices"]][-1]
        assert finish["choices"][0]["finish_reason"] == "abort"
    keyed.engine.reset()


def test_a_route_opts_in_with_the_tag_path_parameters_too() -> None:
    # How a new route joins: the CONTROL tag, on its router or on the route itself.
    router = APIRouter()

    @router.delete("/v1/sessions/{session_id}", tags=[CONTROL])
    async def delete_session(session_id: str) -> None: ...

    @router.get("/v1/sessions/{session_id}")
    async def read_session(session_id: str) -> None: ...

    control_router = APIRouter(tags=[CONTROL])

    @control_router.post("/start_weight_update")
    async def start() -> None: ...

    control = TaggedRoutes([*router.routes, *control_router.routes])
    assert control.need_key("DELETE", "/v1/sessions/abc")
    assert not control.need_key("GET", "/v1/sessions/abc")
    assert control.need_key("POST", "/start_weight_update")
    assert not control.need_key("POST", "/start_weight_update/x")
