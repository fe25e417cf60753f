"""The RL control plane over the fake engine: pause modes with requests in flight and innocent
ones beside, resume, weight versions and reloads, sleep, SGLang's names, aborts, bad input."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fake_engine import Gate, Step
from tests.fast_app import FastApp, sse_chunks

EOS = 2  # SmolLM2's <|im_end|>
PROMPT = [504, 3458, 314, 4649]
OTHER = [9, 9, 9]


def ok(response: Any) -> Any:
    assert response.status_code == 200, response.text
    return response.json() if response.content else None


def generate(fast: FastApp, token_ids: list[int], **sampling: Any) -> Any:
    body = {"token_ids": token_ids, "sampling_params": sampling}
    return fast.client.post("/inference/v1/generate", json=body)


def stream(pool: concurrent.futures.Executor, fast: FastApp, token_ids: list[int]) -> Any:
    """A streamed generate read on ``pool``: a future of its chunks."""
    body = {"token_ids": token_ids, "sampling_params": {}, "stream": True}
    return pool.submit(sse_chunks, fast.client, "/inference/v1/generate", body)


def final(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The last choice delta, with every token of the stream."""
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    return {**choices[-1], "token_ids": [t for c in choices for t in c["token_ids"]]}


def by_prompt(fast: FastApp, scripts: dict[tuple[int, ...], list[Any]]) -> None:
    fast.engine.script = lambda _, prompt, __: scripts[tuple(prompt)]


def test_the_app_serves_from_a_model_dir_without_weights(fast_rl: FastApp) -> None:
    """What the fast apps promise: nothing but the tokenizer, template and configs loads."""
    model_dir = Path(ok(fast_rl.client.get("/model_info"))["model_path"])
    assert (model_dir / "tokenizer.json").is_file()
    assert not [f for f in model_dir.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf")]
    assert fast_rl.client.get("/health").status_code == 200


def test_control_routes_are_off_by_default(fast_smollm2: FastApp) -> None:
    client = fast_smollm2.client
    assert client.post("/pause").status_code == 404
    assert client.post("/update_weights", json={"weight_dir": "/tmp"}).status_code == 404
    # Routers' load endpoints are always there.
    assert ok(client.get("/get_load")) == {"load": 0}
    assert ok(client.get("/load")) == {"server_load": 0}


def test_control_routes_need_the_api_key(fast_rl: FastApp) -> None:
    anonymous = {"Authorization": ""}
    assert fast_rl.client.post("/pause", headers=anonymous).status_code == 401
    response = fast_rl.client.post("/update_weights", json={"weight_dir": "/"}, headers=anonymous)
    assert response.status_code == 401
    assert not fast_rl.engine.paused and fast_rl.engine.loaded_weights == []


def test_pause_abort_ends_requests_in_flight(fast_rl: FastApp) -> None:
    gate = Gate()
    by_prompt(fast_rl, {tuple(PROMPT): [5, 6, Step(7, gate=gate), EOS], tuple(OTHER): [8, EOS]})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reading = stream(pool, fast_rl, PROMPT)
        gate.wait_reached()
        assert ok(fast_rl.client.get("/get_load")) == {"load": 1}
        assert ok(fast_rl.client.post("/pause", params={"mode": "abort"})) == {"status": "paused"}
        aborted = final(reading.result(timeout=10))
    assert aborted["finish_reason"] == "abort" and aborted["token_ids"] == [5, 6]
    assert ok(fast_rl.client.get("/is_paused")) == {"is_paused": True}
    refused = generate(fast_rl, OTHER)
    assert refused.status_code == 503 and "paused" in refused.json()["error"]["message"]
    assert ok(fast_rl.client.post("/resume")) == {"status": "resumed"}
    assert ok(fast_rl.client.get("/is_paused")) == {"is_paused": False}
    assert ok(generate(fast_rl, OTHER))["choices"][0]["token_ids"] == [8, EOS]


def test_pause_wait_lets_requests_finish_and_refuses_new_ones(fast_rl: FastApp) -> None:
    gate = Gate()
    by_prompt(fast_rl, {tuple(PROMPT): [5, Step(6, gate=gate), EOS], tuple(OTHER): [8, EOS]})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        reading = stream(pool, fast_rl, PROMPT)
        gate.wait_reached()
        pausing = pool.submit(fast_rl.client.post, "/pause", params={"mode": "wait"})
        # While the request in flight drains, new ones are refused.
        fast_rl.wait_until(lambda: generate(fast_rl, OTHER).status_code == 503)
        assert not pausing.done()
        gate.open()
        assert ok(pausing.result(timeout=10)) == {"status": "paused"}
        finished = final(reading.result(timeout=10))
    assert finished["finish_reason"] == "stop" and finished["token_ids"] == [5, 6, EOS]
    assert fast_rl.engine.paused
    assert generate(fast_rl, OTHER).status_code == 503
    ok(fast_rl.client.post("/resume"))
    assert ok(generate(fast_rl, OTHER))["choices"][0]["token_ids"] == [8, EOS]


def test_concurrent_wait_pauses_are_all_answered_with_what_happened(fast_rl: FastApp) -> None:
    """Three callers pause(wait) while a request drains and a resume overtakes them: each is
    answered, and told the server was resumed (not "paused", which it is not)."""
    gate = Gate()
    by_prompt(fast_rl, {tuple(PROMPT): [5, Step(6, gate=gate), EOS], tuple(OTHER): [8, EOS]})
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        reading = stream(pool, fast_rl, PROMPT)
        gate.wait_reached()
        pausing = [
            pool.submit(fast_rl.client.post, "/pause", params={"mode": "wait"}) for _ in range(3)
        ]
        fast_rl.wait_until(lambda: generate(fast_rl, OTHER).status_code == 503)
        time.sleep(0.05)  # every pause has reached the engine
        assert not any(p.done() for p in pausing)
        assert ok(fast_rl.client.post("/resume")) == {"status": "resumed"}
        answers = [ok(p.result(timeout=10)) for p in pausing]
        gate.open()
        finished = final(reading.result(timeout=10))
    assert answers == [{"status": "resumed"}] * 3
    assert ok(fast_rl.client.get("/is_paused")) == {"is_paused": False}
    assert finished["token_ids"] == [5, 6, EOS]
    assert ok(generate(fast_rl, OTHER))["choices"][0]["token_ids"] == [8, EOS]


def test_pause_keep_freezes_requests_and_queues_new_ones(fast_rl: FastApp) -> None:
    gate = Gate()
    by_prompt(fast_rl, {tuple(PROMPT): [5, Step(6, gate=gate), EOS], tuple(OTHER): [8, EOS]})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        kept = stream(pool, fast_rl, PROMPT)
        gate.wait_reached()
        ok(fast_rl.client.post("/pause", params={"mode": "keep"}))
        gate.open()
        queued = stream(pool, fast_rl, OTHER)  # admitted, not refused
        fast_rl.wait_until(lambda: len(fast_rl.engine.calls) == 2)
        time.sleep(0.05)  # long enough for a step the pause must hold back
        assert [call.output_ids for call in fast_rl.engine.calls] == [[5], []]
        assert ok(fast_rl.client.get("/get_load")) == {"load": 2}
        ok(fast_rl.client.post("/resume"))
        resumed, innocent = final(kept.result(timeout=10)), final(queued.result(timeout=10))
    assert resumed["token_ids"] == [5, 6, EOS] and resumed["finish_reason"] == "stop"
    assert resumed["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]
    assert innocent["token_ids"] == [8, EOS]


def test_a_reload_between_tokens_splits_the_version_spans(fast_rl: FastApp, tmp_path: Path) -> None:
    """The training loop's shape: pause(keep, clear_cache) mid-request, new weights, resume."""
    gate = Gate()
    fast_rl.engine.script = lambda *_: [5, 6, Step(7, gate=gate), 8, EOS]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reading = stream(pool, fast_rl, PROMPT)
        gate.wait_reached()
        ok(fast_rl.client.post("/pause", params={"mode": "keep", "clear_cache": "true"}))
        assert fast_rl.engine.cache_resets == 1
        loaded = fast_rl.client.post(
            "/update_weights", json={"weight_dir": str(tmp_path), "weight_version": "step-1"}
        )
        assert ok(loaded) == {"success": True, "weight_version": "step-1"}
        assert ok(fast_rl.client.get("/weight_info"))["weight_version"] == "step-1"
        gate.open()
        ok(fast_rl.client.post("/resume"))
        finished = final(reading.result(timeout=10))
    assert finished["weight_versions"] == [
        {"version": "default", "start": 0, "end": 2},
        {"version": "step-1", "start": 2, "end": 5},
    ]
    assert fast_rl.engine.loaded_weights == [(tmp_path, "step-1")]
    # SGLang's name, no version given: reloads are numbered.
    restored = ok(fast_rl.client.post("/update_weights_from_disk", json={"model_path": "/"}))
    assert restored["success"] is True and restored["num_paused_requests"] == 0
    assert ok(fast_rl.client.get("/model_info"))["weight_version"] == "2"


def test_a_version_change_mid_stream_splits_the_spans(fast_rl: FastApp) -> None:
    gate = Gate()
    fast_rl.engine.script = lambda *_: [[5, 6], Step(7, gate=gate), EOS]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reading = stream(pool, fast_rl, PROMPT)
        gate.wait_reached()
        changed = fast_rl.client.post("/update_weight_version", json={"new_version": "v2"})
        assert ok(changed) == {
            "success": True,
            "new_version": "v2",
            "message": "weight version updated",
        }
        gate.open()
        finished = final(reading.result(timeout=10))
    assert finished["weight_versions"] == [
        {"version": "default", "start": 0, "end": 2},
        {"version": "v2", "start": 2, "end": 4},
    ]


def test_bad_weights_are_refused_and_the_old_ones_stay(fast_rl: FastApp, tmp_path: Path) -> None:
    refused = fast_rl.client.post("/update_weights", json={"weight_dir": str(tmp_path / "no")})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["message"].startswith("weights not loaded")
    assert ok(fast_rl.client.get("/weight_info"))["weight_version"] == "default"


def test_abort_all_with_update_weight_version(fast_rl: FastApp) -> None:
    gate = Gate()
    fast_rl.engine.script = lambda *_: [5, Step(6, gate=gate), EOS]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reading = stream(pool, fast_rl, PROMPT)
        gate.wait_reached()
        body = {"new_version": "v3", "abort_all_requests": True}
        ok(fast_rl.client.post("/update_weight_version", json=body))
        aborted = final(reading.result(timeout=10))
    assert aborted["finish_reason"] == "abort" and aborted["token_ids"] == [5]
    assert aborted["weight_versions"] == [{"version": "default", "start": 0, "end": 1}]


@pytest.mark.parametrize(
    ("method", "path", "kwargs"),
    [
        ("post", "/pause", {"params": {"mode": "sometimes"}}),
        ("post", "/pause", {"params": {"clear_cache": "maybe"}}),
        ("post", "/sleep", {"params": {"level": 3}}),
        ("post", "/update_weight_version", {"json": {}}),
        ("post", "/update_weight_version", {"json": {"new_version": ""}}),
        ("post", "/update_weights", {"json": {"weights": "/tmp"}}),
        ("post", "/update_weights_from_disk", {"json": {"model_path": 3}}),
        # A component longer than the OS allows (was a 500).
        ("post", "/update_weights", {"json": {"weight_dir": "/tmp/" + "a" * 300}}),
        ("post", "/update_weights_from_disk", {"json": {"model_path": "/tmp/" + "a" * 300}}),
        ("post", "/pause_generation", {"json": {"mode": "later"}}),
        ("post", "/abort_requests", {"json": {"request_ids": "all"}}),
    ],
)
def test_control_bad_input_is_a_400(fast_rl: FastApp, method: str, path: str, kwargs: dict) -> None:
    response = getattr(fast_rl.client, method)(path, **kwargs)
    assert response.status_code == 400, response.text
    assert ok(fast_rl.client.get("/is_paused")) == {"is_paused": False}
    assert not fast_rl.engine.paused


@pytest.mark.parametrize(
    ("path", "query", "headers", "content"),
    [
        # curl -d sends a form body: the bad query parameter is still what is named.
        ("/sleep", {"level": "deep"}, {"content-type": "application/x-www-form-urlencoded"}, b"a"),
        ("/sleep", {"level": "deep"}, {"content-type": "text/plain"}, b"{}"),
        ("/pause", {"clear_cache": "maybe"}, {"content-type": "text/plain"}, b"x"),
        ("/flush_cache", {"timeout": "soon"}, {"content-type": "application/json"}, b"{"),
    ],
)
def test_a_bad_query_parameter_is_named(
    fast_rl: FastApp, path: str, query: dict, headers: dict, content: bytes
) -> None:
    (name,) = query
    response = fast_rl.client.post(path, params=query, headers=headers, content=content)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == name and name in error["message"], error
    assert "must be JSON" not in error["message"]
    assert ok(fast_rl.client.get("/is_paused")) == {"is_paused": False}


def test_versions_sleep_and_the_sglang_names(fast_rl: FastApp) -> None:
    client = fast_rl.client
    fast_rl.engine.script = lambda *_: [5, 6, 7]
    assert (
        ok(client.post("/update_weight_version", json={"new_version": "v7"}))["new_version"] == "v7"
    )
    choice = ok(generate(fast_rl, PROMPT, max_tokens=3))["choices"][0]
    assert choice["weight_versions"] == [{"version": "v7", "start": 0, "end": 3}]
    assert ok(client.post("/reset_prefix_cache")) == {"success": True}
    assert fast_rl.engine.cache_resets == 1
    assert ok(client.get("/get_world_size")) == {"world_size": 1}
    # Sleep: requests are refused until wake-up.
    ok(client.post("/sleep", params={"level": 1}))
    assert ok(client.get("/is_sleeping")) == {"is_sleeping": True}
    assert generate(fast_rl, PROMPT, max_tokens=2).status_code == 503
    ok(client.post("/wake_up"))
    assert ok(client.get("/is_sleeping")) == {"is_sleeping": False}
    # SGLang's pause modes in vLLM's terms: abort; retract = keep and drop the KV; in place.
    for mode, finish, cache_resets in (
        ("abort", "abort", 1),
        ("retract", "stop", 2),
        ("in_place", "stop", 2),
    ):
        gate = Gate()
        fast_rl.engine.script = lambda *_, gate=gate: [5, Step(6, gate=gate), EOS]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reading = stream(pool, fast_rl, PROMPT)
            gate.wait_reached()
            paused = ok(client.post("/pause_generation", json={"mode": mode}))
            assert paused == {"message": "Generation paused.", "status": "ok"}
            gate.open()
            assert ok(client.post("/continue_generation", json={}))["status"] == "ok"
            assert final(reading.result(timeout=10))["finish_reason"] == finish
        assert fast_rl.engine.cache_resets == cache_resets
    # SGLang's abort: one by rid, or all.
    gate = Gate()
    fast_rl.engine.script = lambda *_: [5, Step(6, gate=gate), EOS]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reading = stream(pool, fast_rl, PROMPT)
        gate.wait_reached()
        assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
        assert final(reading.result(timeout=10))["finish_reason"] == "abort"
    # vLLM's two abort shapes.
    assert ok(client.post("/abort_requests", json={})) == {"status": "aborted", "aborted": 0}
    assert client.post("/inference/v1/abort_requests", json={"request_ids": []}).status_code == 200


def test_abort_by_rid_leaves_other_requests_alone(fast_rl: FastApp) -> None:
    gates = {tuple(PROMPT): Gate(), tuple(OTHER): Gate()}
    fast_rl.engine.script = lambda _, prompt, __: [5, Step(6, gate=gates[tuple(prompt)]), EOS]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        target = pool.submit(
            fast_rl.client.post, "/generate", json={"input_ids": PROMPT, "rid": "target"}
        )
        innocent = stream(pool, fast_rl, OTHER)
        for gate in gates.values():
            gate.wait_reached()
        assert fast_rl.client.post("/abort_request", json={"rid": "target"}).status_code == 200
        meta = target.result(timeout=10).json()["meta_info"]
        assert meta["finish_reason"] == {"type": "abort", "message": "aborted"}
        gates[tuple(OTHER)].open()
        assert final(innocent.result(timeout=10))["token_ids"] == [5, 6, EOS]


def stop_string_choice(fast: FastApp, route: str) -> tuple[list[int], list[dict[str, Any]]]:
    """A choice ending on the stop string "Paris": its ids and weight versions on ``route``."""
    if route == "sglang":
        body = {"input_ids": PROMPT, "sampling_params": {"stop": ["Paris"]}}
        data = ok(fast.client.post("/generate", json=body))
        return data["output_ids"], data["meta_info"]["weight_versions"]
    if route == "sglang-stream":
        body = {"input_ids": PROMPT, "sampling_params": {"stop": ["Paris"]}, "stream": True}
        last = sse_chunks(fast.client, "/generate", body)[-1]
        return last["output_ids"], last["meta_info"]["weight_versions"]
    body = {"token_ids": PROMPT, "sampling_params": {"stop": ["Paris"]}}
    if route == "generate":
        choice = ok(fast.client.post("/inference/v1/generate", json=body))["choices"][0]
    else:
        choice = final(sse_chunks(fast.client, "/inference/v1/generate", {**body, "stream": True}))
    assert choice["stop_reason"] == "Paris"
    return choice["token_ids"], choice["weight_versions"]


@pytest.mark.parametrize("route", ["generate", "generate-stream", "sglang", "sglang-stream"])
def test_a_choice_ending_on_a_stop_string_keeps_its_version(fast_rl: FastApp, route: str) -> None:
    ids = fast_rl.tokenize("The capital of France is Paris. It is big.")
    fast_rl.engine.script = lambda *_: [*ids, EOS]
    ok(fast_rl.client.post("/update_weight_version", json={"new_version": "v7"}))
    token_ids, versions = stop_string_choice(fast_rl, route)
    assert token_ids == ids[: ids.index(fast_rl.tokenize(" Paris")[0]) + 1]
    assert versions == [{"version": "v7", "start": 0, "end": len(token_ids)}]
