"""The control plane's transitions over the fake engine: vLLM's weight-transfer phases in and out
of order, an open update's deadline, refused bodies mid-update, reloads during a transfer and
side by side, and adapter versions held by the requests that run under them.

The app (``fast_control``) abandons an open update after one second with no call of it, and
serves LoRA with two slots. Every innocent request here must get its answer."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.conftest import assert_error
from tests.fake_engine import FAKE_LAYOUT, Gate, Reply, Step
from tests.fast_app import FastApp
from tokenwire import adapter_files

PROMPT = [5, 6, 7]  # none of them eos
GROUP = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return (
        response.json() if response.headers["content-type"].startswith("application/json") else None
    )


def info(names: list[str], *, dtype: str = "float32", **fields: Any) -> dict[str, Any]:
    """An ``update_info`` for ``names`` of the fake layout."""
    shapes = [list(FAKE_LAYOUT[name]) for name in names]
    return {"names": names, "dtype_names": [dtype] * len(names), "shapes": shapes, **fields}


def generate(app: FastApp, max_tokens: int = 2) -> httpx.Response:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": max_tokens}}
    return app.client.post("/inference/v1/generate", json=body)


def weights(app: FastApp) -> dict[str, Any]:
    return ok(app.client.get("/weight_info"))


def open_update(app: FastApp) -> None:
    ok(app.client.post("/init_weight_transfer_engine", json={"init_info": GROUP}))
    ok(app.client.post("/start_weight_update"))
    assert app.engine.paused  # start paused generation (keep)


def test_the_four_phases_in_order(fast_control: FastApp) -> None:
    app = fast_control
    open_update(app)
    assert weights(app)["state"] == "updating"
    ok(app.client.post("/update_weights", json={"update_info": info(list(FAKE_LAYOUT))}))
    ok(app.client.post("/finish_weight_update", json={"weight_version": "step-1"}))
    assert weights(app) == {"weight_version": "step-1", "state": "whole", "reason": None}
    assert not app.engine.paused and app.engine.received == list(FAKE_LAYOUT)
    choice = ok(generate(app))["choices"][0]
    assert choice["weight_versions"][0]["version"] == "step-1"


def test_phases_out_of_order_change_nothing(fast_control: FastApp) -> None:
    app = fast_control
    body = {"update_info": info(list(FAKE_LAYOUT))}
    assert_error(app.client.post("/update_weights", json=body), 400, "not initialised")
    assert_error(app.client.post("/finish_weight_update"), 400, "without a matching start")
    ok(app.client.post("/init_weight_transfer_engine", json={"init_info": GROUP}))
    assert_error(app.client.post("/update_weights", json=body), 400, "start_weight_update")
    ok(app.client.post("/start_weight_update"))
    assert_error(app.client.post("/start_weight_update"), 400, "already active")
    assert_error(app.client.post("/shutdown_weight_transfer_engine"), 400, "during a weight")
    assert weights(app)["state"] == "updating" and app.engine.received == []


@pytest.mark.parametrize(
    "update_info",
    [
        info(["model.embed_tokens.weight"], dtype="Tensor"),
        {"names": ["model.embed_tokens.weight"], "dtype_names": ["float32"], "shapes": [[-8, 4]]},
        {"names": ["a", "b"], "dtype_names": ["float32"], "shapes": [[1]]},
    ],
    ids=["dtype-Tensor", "negative-dimension", "lists-of-different-lengths"],
)
def test_a_malformed_body_mid_update_then_resume(
    fast_control: FastApp, update_info: dict[str, Any]
) -> None:
    """The body is a 400 and changes nothing; the requests queued behind the update's pause go
    on at /resume, and the weights, which no byte reached, stay whole."""
    app = fast_control
    open_update(app)
    with ThreadPoolExecutor(2) as pool:
        innocent = pool.submit(generate, app)
        app.wait_until(lambda: len(app.engine.live) == 1)
        assert_error(app.client.post("/update_weights", json={"update_info": update_info}), 400)
        assert weights(app)["state"] == "updating"
        ok(app.client.post("/resume"))
        assert ok(innocent.result(timeout=10))["choices"][0]["finish_reason"] == "length"
    assert weights(app)["state"] == "whole"
    assert_error(app.client.post("/finish_weight_update"), 400, "without a matching start")
    ok(generate(app))


def test_a_trainer_that_vanishes_after_start(fast_control: FastApp) -> None:
    """No call for the deadline: the update is abandoned, its pause lifted, the group closed,
    the weights whole; the request that waited gets its answer."""
    app = fast_control
    open_update(app)
    with ThreadPoolExecutor(1) as pool:
        innocent = pool.submit(generate, app)
        assert ok(innocent.result(timeout=10))["choices"][0]["finish_reason"] == "length"
    assert weights(app)["state"] == "whole" and app.engine.group is None
    assert not app.engine.paused
    ok(app.client.post("/init_weight_transfer_engine", json={"init_info": GROUP}))  # a new one


def test_finish_without_tensors_changes_nothing(fast_control: FastApp) -> None:
    app = fast_control
    open_update(app)
    assert_error(app.client.post("/finish_weight_update"), 400, "carried no tensors")
    assert weights(app)["state"] == "whole" and not app.engine.paused
    ok(generate(app))


def test_a_refusal_after_some_tensors_came_breaks_the_weights(fast_control: FastApp) -> None:
    app = fast_control
    open_update(app)
    first = {"update_info": info(["model.embed_tokens.weight"])}
    ok(app.client.post("/update_weights", json=first))
    misfit = {"names": ["model.embed_tokens.weight"], "dtype_names": ["float32"]}
    misfit["shapes"] = [[2, 2]]
    error = assert_error(app.client.post("/update_weights", json={"update_info": misfit}), 400)
    assert "the group is closed" in error["message"] and app.engine.group is None
    state = weights(app)
    assert state["state"] == "broken" and "refused after some" in state["reason"]
    assert_error(generate(app), 503, "not whole")
    assert_error(app.client.post("/resume"), 400, "not whole")
    reload = {"weight_dir": str(app.model_dir), "weight_version": "mended"}
    assert ok(app.client.post("/update_weights", json=reload))["weight_version"] == "mended"
    assert weights(app)["state"] == "whole" and not app.engine.paused  # the update's pause
    ok(generate(app))


def test_a_broadcast_that_breaks_off(fast_control: FastApp) -> None:
    app = fast_control
    open_update(app)
    app.engine.break_receive = True
    body = {"update_info": info(list(FAKE_LAYOUT))}
    assert_error(app.client.post("/update_weights", json=body), 400, "went away mid-broadcast")
    assert weights(app)["state"] == "broken"
    assert_error(generate(app), 503, "broke off")


def test_a_reload_during_an_open_update_is_refused(fast_control: FastApp) -> None:
    app = fast_control
    open_update(app)
    reload = {"weight_dir": str(app.model_dir), "weight_version": "r"}
    assert_error(app.client.post("/update_weights", json=reload), 400, "a weight update is open")
    assert weights(app)["state"] == "updating" and app.engine.loaded_weights == []


def test_a_reload_waits_for_a_receive_in_progress(fast_control: FastApp) -> None:
    """Both are transitions of the weights: the reload runs once the receive ended."""
    app = fast_control
    open_update(app)
    gate = app.engine.receive_gate = Gate()
    with ThreadPoolExecutor(2) as pool:
        body = {"update_info": info(list(FAKE_LAYOUT))}
        receiving = pool.submit(app.client.post, "/update_weights", json=body)
        gate.wait_reached()
        reload = {"weight_dir": str(app.model_dir)}
        reloading = pool.submit(app.client.post, "/update_weights", json=reload)
        assert not reloading.done()
        gate.open()
        ok(receiving.result(timeout=10))
        assert_error(reloading.result(timeout=10), 400, "a weight update is open")


def test_concurrent_reloads_get_different_versions(fast_control: FastApp) -> None:
    app = fast_control
    reload = {"weight_dir": str(app.model_dir)}
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(lambda _: app.client.post("/update_weights", json=reload), range(4))
        )
    versions = [ok(answer)["weight_version"] for answer in answers]
    assert len(set(versions)) == 4
    assert [version for _, version in app.engine.loaded_weights] == sorted(versions, key=int)


# -- adapters ---------------------------------------------------------------------------------


def _adapter_dir(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    factor = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    adapter_files.write(path, {"r": 4, "lora_alpha": 8}, {factor: torch.zeros(4, 576)})
    return str(path)


def _held_request(app: FastApp, model: str, gate: Gate) -> Future[httpx.Response]:
    """A request under ``model`` that waits at ``gate`` after its first token."""
    app.engine.script = lambda *_: Reply([Step(5), Step(6, gate=gate)])
    body = {"model": model, "token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}
    pool = ThreadPoolExecutor(1)
    future = pool.submit(app.client.post, "/inference/v1/generate", json=body)
    pool.shutdown(wait=False)
    gate.wait_reached()
    return future


def test_an_adapter_version_lives_while_a_request_holds_it(
    fast_control: FastApp, tmp_path: Path
) -> None:
    """A request keeps the version it started under through an in-place replace and an
    unload; that version leaves the engine when the request ends. Two slots (--max-loras 2):
    a second adapter is refused while the first's replaced version is held."""
    app = fast_control
    load = {"lora_name": "a", "lora_path": _adapter_dir(tmp_path, "a"), "weight_version": "a-1"}
    ok(app.client.post("/v1/load_lora_adapter", json=load))
    gate = Gate()
    held = _held_request(app, "a", gate)
    replace = {**load, "load_inplace": True, "weight_version": "a-2"}
    ok(app.client.post("/v1/load_lora_adapter", json=replace))
    assert sorted(v.version for v in app.engine.adapters.values()) == ["a-1", "a-2"]
    other = {"lora_name": "b", "lora_path": _adapter_dir(tmp_path, "b")}
    assert_error(app.client.post("/v1/load_lora_adapter", json=other), 400, "--max-loras")
    ok(app.client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}))
    assert [v.version for v in app.engine.adapters.values()] == ["a-1"]  # still held
    gate.open()
    answer = ok(held.result(timeout=10))
    assert [span["version"] for span in answer["choices"][0]["weight_versions"]] == ["a-1"]
    app.wait_until(lambda: not app.engine.adapters)  # released, then evicted
    ok(app.client.post("/v1/load_lora_adapter", json=other))  # the slot is free


def test_a_request_for_an_unloaded_adapter(fast_control: FastApp, tmp_path: Path) -> None:
    app = fast_control
    load = {"lora_name": "a", "lora_path": _adapter_dir(tmp_path, "a")}
    ok(app.client.post("/v1/load_lora_adapter", json=load))
    ok(app.client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}))
    body = {"model": "a", "prompt": "hi", "max_tokens": 2}
    assert_error(app.client.post("/v1/completions", json=body), 404, "does not exist")
    sglang = {"text": "hi", "lora_path": "a", "sampling_params": {"max_new_tokens": 2}}
    assert_error(app.client.post("/generate", json=sglang), 400, "lora_path: no LoRA adapter")
    assert not app.engine.adapters and not app.engine.calls


def test_adapter_factors_over_the_group_load_at_finish(fast_control: FastApp) -> None:
    """vLLM's phases with ``lora_name``: the model is untouched, the adapter loads at finish
    and the update's pause is lifted."""
    app = fast_control
    open_update(app)
    factor = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    body = {
        "names": [factor],
        "dtype_names": ["float32"],
        "shapes": [[4, 4]],
        "lora_name": "t",
        "lora_config": {"r": 4, "lora_alpha": 8},
    }
    ok(app.client.post("/update_weights", json={"update_info": body}))
    ok(app.client.post("/finish_weight_update", json={"weight_version": "t-1"}))
    assert [v.version for v in app.engine.adapters.values()] == ["t-1"]
    assert weights(app)["state"] == "whole" and not app.engine.paused
    assert app.engine.received == []  # no base weight was written


def test_innocent_streams_finish_beside_a_refused_update(fast_control: FastApp) -> None:
    """A stream running when an update opens (keep) finishes once the refused update ended."""
    app = fast_control
    app.engine.script = lambda *_: Reply([Step(5), Step(6)])
    with ThreadPoolExecutor(1) as pool:
        ok(app.client.post("/init_weight_transfer_engine", json={"init_info": GROUP}))
        ok(app.client.post("/start_weight_update"))
        running = pool.submit(generate, app)
        misfit = {"names": ["nope"], "dtype_names": ["float32"], "shapes": [[1]]}
        assert_error(app.client.post("/update_weights", json={"update_info": misfit}), 400)
        answer = ok(running.result(timeout=10))
    assert answer["choices"][0]["token_ids"] == [5, 6]
    assert weights(app)["state"] == "whole"


# -- the trainer's group ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "port", "message"),
    [
        ("169.254.169.254", 29500, "metadata addresses are never dialled"),
        ("fd00:ec2::254", 29500, "metadata addresses are never dialled"),
        ("::ffff:169.254.169.254", 29500, "metadata addresses are never dialled"),
        ("8.8.8.8", 29500, "outside the allowed networks"),
        ("224.0.0.1", 29500, "not a host address"),
        ("127.0.0.1", 22, "below 1024"),
    ],
)
def test_trainer_addresses_are_checked_before_dialling(
    fast_control: FastApp, address: str, port: int, message: str
) -> None:
    app = fast_control
    init_info = {**GROUP, "master_address": address, "master_port": port}
    assert_error(
        app.client.post("/init_weight_transfer_engine", json={"init_info": init_info}), 400, message
    )
    sglang = {**init_info, "backend": "gloo"}
    assert_error(app.client.post("/init_weights_update_group", json=sglang), 400, message)
    assert app.engine.group is None  # nothing was dialled


def test_the_checked_address_is_the_one_dialled(fast_control: FastApp) -> None:
    """A name is resolved once: the engine dials the address that was checked."""
    app = fast_control
    init_info = {**GROUP, "master_address": "localhost"}
    ok(app.client.post("/init_weight_transfer_engine", json={"init_info": init_info}))
    assert app.engine.group is not None
    assert app.engine.group.master_address in ("127.0.0.1", "::1")
    assert app.engine.group.group_name is None  # vLLM's bodies: the trainer's default group


def test_sglang_style_trainers_as_they_send(fast_control: FastApp) -> None:
    """AReaL's port as a string; skyrl-train's updates without a group name use the one open
    group; a new init replaces a group whose trainer is gone (TRL never shuts it down)."""
    app = fast_control
    group = {**GROUP, "master_address": "10.1.2.3", "master_port": "29500"}
    group |= {"group_name": "skyrl", "backend": "gloo"}
    ok(app.client.post("/init_weights_update_group", json=group))
    assert app.engine.group is not None and app.engine.group.group_name == "skyrl"
    name = "model.embed_tokens.weight"
    body = {"name": name, "dtype": "float32", "shape": list(FAKE_LAYOUT[name])}
    assert ok(app.client.post("/update_weights_from_distributed", json=body))["success"]
    assert app.engine.received == [name]
    elsewhere = {**body, "group_name": "other"}
    assert_error(
        app.client.post("/update_weights_from_distributed", json=elsewhere), 400, "'other'"
    )
    ok(app.client.post("/init_weight_transfer_engine", json={"init_info": GROUP}))
    assert app.engine.group is not None and app.engine.group.group_name is None
    ok(app.client.post("/destroy_weights_update_group", json={}))
    assert app.engine.group is None


def test_the_servers_logprobs_mode_unless_a_request_names_one(fast_control: FastApp) -> None:
    """TRL's vllm-serve starts vLLM with --logprobs-mode processed_logprobs and sends no mode."""
    app = fast_control
    info = ok(app.client.get("/server_info", params={"config_format": "json"}))
    assert info["vllm_config"]["model_config"]["logprobs_mode"] == "processed_logprobs"
    sampling = {"max_tokens": 2, "temperature": 0.7, "logprobs": 1}
    ok(
        app.client.post(
            "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": sampling}
        )
    )
    raw = {**sampling, "logprobs_mode": "raw_logprobs"}
    ok(
        app.client.post(
            "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": raw}
        )
    )
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True}
    ok(app.client.post("/v1/chat/completions", json=chat))
    modes = [call.sampling.logprobs_mode for call in app.engine.calls]
    assert modes == ["processed_logprobs", "raw_logprobs", "processed_logprobs"]


def test_areals_wake_up_in_two_steps(fast_control: FastApp) -> None:
    """AReaL: release everything, then resume ``weights``, then ``kv_cache``."""
    app = fast_control
    ok(app.client.post("/release_memory_occupation", json={}))
    assert ok(app.client.get("/is_sleeping"))["is_sleeping"] is True
    assert_error(generate(app), 503, "sleeping")
    ok(app.client.post("/resume_memory_occupation", json={"tags": ["weights"]}))
    assert ok(app.client.get("/is_sleeping"))["is_sleeping"] is True
    ok(app.client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}))
    assert ok(app.client.get("/is_sleeping"))["is_sleeping"] is False
    ok(generate(app))
