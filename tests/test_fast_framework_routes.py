"""Routes the RL frameworks' own bundled servers add, sent the bodies their released clients
send (copied from skyrl 0.4.0, skyrl-train 0.3.1, areal 1.0.4 and atroposlib 0.4.0 as literal
dicts; each cites where), answered in the shapes those clients read, over the fake engine."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import assert_error
from tests.fake_engine import FAKE_LAYOUT, Gate, Step
from tests.fast_app import FastApp, sse_chunks
from tokenwire.engine.base import AdapterTensors

EOS = 2
PROMPT = [5, 6, 7]  # none of them eos
GROUP = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
SERVED = (
    "skyrl_sleep_for_weight_sync",
    "skyrl_wake_for_weight_sync",
    "skyrl_set_lora_receive_target",
    "skyrl_discard_in_memory_lora",
)


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json() if response.headers["content-type"] == "application/json" else None


def held_stream(pool: concurrent.futures.Executor, app: FastApp, gate: Gate) -> Any:
    """A streamed generate whose second token waits at ``gate``: a future of its chunks."""
    app.engine.script = lambda *_: [5, Step(6, gate=gate), EOS]
    body = {"token_ids": PROMPT, "sampling_params": {}, "stream": True}
    return pool.submit(sse_chunks, app.client, "/inference/v1/generate", body)


def finish_reason(chunks: list[dict[str, Any]]) -> str:
    return [c["choices"][0] for c in chunks if c["choices"]][-1]["finish_reason"]


def generate(app: FastApp) -> httpx.Response:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}
    return app.client.post("/inference/v1/generate", json=body)


# -- SkyRL: /collective_rpc ---------------------------------------------------------------------


def test_sleep_for_weight_sync_keeps_frozen_requests(fast_control: FastApp) -> None:
    """SkyRL's fully-async sync (worker_dispatch.py, save_weights_for_sampler): KEEP-pause,
    sleep, wake weights, (broadcast), wake kv_cache, resume. The request in flight is frozen,
    not aborted; one sent meanwhile queues; ``offload_kv: false`` drops the kept KV."""
    app = fast_control
    client = app.client
    gate = Gate()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = held_stream(pool, app, gate)
        gate.wait_reached()
        # remote_inference_client.py, RemoteInferenceClient.pause (params of pause_generation).
        ok(client.post("/pause", params={"mode": "keep", "clear_cache": "false"}))
        resets = app.engine.cache_resets
        # RemoteInferenceClient.sleep_for_weight_sync / wake_for_weight_sync.
        sleep = {"method": "skyrl_sleep_for_weight_sync", "kwargs": {"offload_kv": False}}
        assert ok(client.post("/collective_rpc", json=sleep)) == {"results": [None]}
        assert app.engine.paused and app.engine.cache_resets == resets + 1
        queued = pool.submit(generate, app)
        wake = {"method": "skyrl_wake_for_weight_sync", "kwargs": {"tags": ["weights"]}}
        assert ok(client.post("/collective_rpc", json=wake)) == {"results": [None]}
        wake = {"method": "skyrl_wake_for_weight_sync", "kwargs": {"tags": ["kv_cache"]}}
        assert ok(client.post("/collective_rpc", json=wake)) == {"results": [None]}
        assert app.engine.paused  # SkyRL's wake does not resume; its caller does
        gate.open()
        ok(client.post("/resume"))
        assert finish_reason(running.result(timeout=10)) == "stop"
        assert ok(queued.result(timeout=10))["choices"][0]["finish_reason"] is not None


def test_lora_receive_target_makes_the_next_update_an_adapter(fast_control: FastApp) -> None:
    """``lora.sync_mode=memory`` (megatron_worker.py, the memory LoRA publish): arm the target
    over /collective_rpc (lora_target.py, build_lora_receive_target), send the factors with
    vLLM's phases (names, dtypes and shapes only), then register the adapter in memory
    (RemoteInferenceClient.load_lora_adapter, ``in_memory=True``)."""
    app = fast_control
    client = app.client
    sent = "base_model.model.model.layers.0.mlp.experts.0.down_proj.lora_A.weight"
    alias = "base_model.model.model.layers.0.mlp.experts.1.down_proj.lora_A.weight"
    receive_target = {
        "kind": "lora",
        "lora_name": "skyrl-lora",
        "adapter_config": {"r": 4, "lora_alpha": 8, "target_modules": ["down_proj"]},
        "aliases": {alias: sent},
    }
    ok(client.post("/init_weight_transfer_engine", json={"init_info": GROUP}))  # at start-up
    # RemoteInferenceClient.set_lora_receive_target, each round before the send.
    arm = {"method": "skyrl_set_lora_receive_target", "kwargs": {"receive_target": receive_target}}
    assert ok(client.post("/collective_rpc", json=arm)) == {"results": [None]}
    ok(client.post("/start_weight_update"))
    update_info = {"names": [sent], "dtype_names": ["float32"], "shapes": [[4, 4]]}
    ok(client.post("/update_weights", json={"update_info": update_info}))
    ok(client.post("/finish_weight_update"))
    assert app.engine.received == []  # no base weight was written
    body = {"lora_name": "skyrl-lora", "in_memory": True}
    ok(client.post("/skyrl/v1/load_lora_adapter", json=body))
    (source,) = app.engine.adapter_sources.values()
    assert isinstance(source, AdapterTensors) and set(source.tensors) == {sent, alias}
    assert source.tensors[alias] is source.tensors[sent]  # shared, as SkyRL's receiver does
    # Disarmed at finish: the next round carries the model's weights again.
    ok(client.post("/start_weight_update"))
    update_info = {"names": list(FAKE_LAYOUT), "dtype_names": ["float32"] * len(FAKE_LAYOUT)}
    update_info["shapes"] = [list(shape) for shape in FAKE_LAYOUT.values()]
    ok(client.post("/update_weights", json={"update_info": update_info}))
    ok(client.post("/finish_weight_update"))
    assert app.engine.received == list(FAKE_LAYOUT)


def test_in_memory_load_needs_an_armed_update(fast_control: FastApp) -> None:
    body = {"lora_name": "never-sent", "in_memory": True}
    error = assert_error(fast_control.client.post("/skyrl/v1/load_lora_adapter", json=body), 400)
    assert error["param"] == "in_memory" and "skyrl_set_lora_receive_target" in error["message"]
    both = {"lora_name": "x", "in_memory": True, "lora_path": "/tmp"}
    assert_error(fast_control.client.post("/skyrl/v1/load_lora_adapter", json=both), 400)


def test_discard_in_memory_lora_answers_false(fast_control: FastApp) -> None:
    """RemoteInferenceClient.unload_lora_adapter calls it after the unload (best effort)."""
    body = {"method": "skyrl_discard_in_memory_lora", "kwargs": {"lora_name": "skyrl-lora"}}
    assert ok(fast_control.client.post("/collective_rpc", json=body)) == {"results": [False]}


def test_other_collective_rpc_methods_are_a_400_naming_the_served_ones(
    fast_control: FastApp,
) -> None:
    client = fast_control.client
    for method in ("load_weights", "reset_prefix_cache", "__init__", "fetch_weights"):
        error = assert_error(client.post("/collective_rpc", json={"method": method}), 400)
        assert error["param"] == "method" and repr(method) in error["message"]
        assert all(name in error["message"] for name in SERVED)
    bad = {"method": "skyrl_sleep_for_weight_sync", "kwargs": {"offload_kv": "yes"}}
    assert assert_error(client.post("/collective_rpc", json=bad), 400)["param"] == (
        "kwargs.offload_kv"
    )
    unknown = {"method": "skyrl_wake_for_weight_sync", "kwargs": {"tags": ["gpu"]}}
    assert assert_error(client.post("/collective_rpc", json=unknown), 400)["param"] == (
        "kwargs.tags.0"
    )
    positional = {"method": "skyrl_sleep_for_weight_sync", "args": [True]}
    assert assert_error(client.post("/collective_rpc", json=positional), 400)["param"] == "args"
    assert not fast_control.engine.paused


def test_fetch_weights_says_the_delta_backend_is_not_served(fast_control: FastApp) -> None:
    """RemoteInferenceClient.fetch_weights (delta/trainer.py, _apply_receiver_update)."""
    body = {"target_version": 3, "sync_dir": "/shared/skyrl-sync"}
    error = assert_error(fast_control.client.post("/fetch_weights", json=body), 400)
    assert "checkpoint-delta" in error["message"]


# -- skyrl-train: /init_weight_update_communicator ----------------------------------------------


def test_skyrl_train_init_weight_update_communicator(fast_control: FastApp) -> None:
    """remote_inference_engine.py, init_communicator: ``asdict(BroadcastInitInfo)``, joined as
    SGLang's group (broadcast_strategy.py: init_custom_process_group, ``group_name``)."""
    app = fast_control
    init_info = {
        "override_existing_receiver": True,
        "master_addr": "127.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "skyrl",
        "backend": "gloo",
        "model_dtype_str": "bfloat16",
    }
    assert ok(app.client.post("/init_weight_update_communicator", json=init_info)) == {
        "status": "ok"
    }
    group = app.engine.group
    assert group is not None and (group.group_name, group.rank, group.world_size) == (
        "skyrl",
        1,
        2,
    )
    # override_existing_receiver false keeps the open group, as skyrl-train's worker does.
    kept = {**init_info, "override_existing_receiver": False, "master_port": 29501}
    ok(app.client.post("/init_weight_update_communicator", json=kept))
    assert app.engine.group is group
    replaced = {**init_info, "master_port": 29502}
    ok(app.client.post("/init_weight_update_communicator", json=replaced))
    assert app.engine.group is not None and app.engine.group.master_port == 29502
    ok(app.client.post("/destroy_weights_update_group"))  # skyrl-train's destroy_group
    assert app.engine.group is None


# -- AReaL's vLLM server ------------------------------------------------------------------------


def test_areal_pause_and_continue_generation(fast_control: FastApp) -> None:
    """vllm_remote.py, get_pause_request / get_resume_request (payload ``{}``): requests in
    flight end, new ones wait for the continue rather than failing."""
    app = fast_control
    gate = Gate()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = held_stream(pool, app, gate)
        gate.wait_reached()
        assert ok(app.client.post("/areal_pause_generation", json={})) == {
            "success": True,
            "message": "Generation paused and all requests aborted",
        }
        gate.open()
        assert finish_reason(running.result(timeout=10)) == "abort"
        app.engine.script = lambda *_: [5, EOS]
        held = pool.submit(generate, app)
        app.wait_until(lambda: app.engine.paused)
        assert not held.done()
        assert ok(app.client.post("/areal_continue_generation", json={})) == {
            "success": True,
            "message": "Generation continued",
        }
        assert ok(held.result(timeout=10))["choices"][0]["token_ids"] == [5, EOS]
    assert not app.engine.paused


def test_areal_update_weights_from_disk(fast_control: FastApp, tmp_path: Path) -> None:
    """vllm_remote.py, build_disk_weight_update_requests: ``{"model_path": ...}``."""
    app = fast_control
    answer = ok(app.client.post("/areal_update_weights", json={"model_path": str(tmp_path)}))
    assert answer == {"success": True, "message": "TP rank: 0 success\n"}
    assert [path for path, _ in app.engine.loaded_weights] == [tmp_path]
    missing = {"model_path": str(tmp_path / "missing")}
    assert_error(app.client.post("/areal_update_weights", json=missing), 400)


def test_areal_init_weights_update_group(fast_control: FastApp) -> None:
    """vllm_remote.py, build_init_weights_group_request (the port as a string)."""
    app = fast_control
    payload = {
        "master_address": "127.0.0.1",
        "master_port": "29500",
        "rank_offset": 1,
        "world_size": 2,
        "backend": "gloo",
        "group_name": "areal-group",
    }
    answer = ok(app.client.post("/areal_init_weights_update_group", json=payload))
    assert answer == {"success": True, "message": "TP rank: 0 success\n"}
    group = app.engine.group
    assert group is not None and (group.group_name, group.master_port) == ("areal-group", 29500)


AREAL_GROUP = {**GROUP, "master_port": "29500", "backend": "gloo", "group_name": "areal-group"}


def areal_meta(names: list[str], group_name: str = "areal-group") -> dict[str, Any]:
    """vllm_remote.py, build_distributed_weight_update_requests: the meta request's payload
    (ParamSpec's dtype as FSDPEngine writes it, ``str(dtype).split("torch.")[1]``)."""
    return {
        "names": names,
        "dtypes": ["float32"] * len(names),
        "shapes": [list(FAKE_LAYOUT[name]) for name in names],
        "group_name": group_name,
    }


def test_areal_two_step_distributed_update(fast_control: FastApp) -> None:
    """vllm_remote.py: pause, then per bucket ``/areal_set_update_weight_meta`` and
    ``/areal_update_weights_xccl`` (payload ``{}``) in that order, then continue. The tensors
    are received on the second call; the pause AReaL took stays until its continue."""
    app = fast_control
    client = app.client
    success = {"success": True, "message": "TP rank: 0 success\n"}
    assert ok(client.post("/areal_init_weights_update_group", json=AREAL_GROUP)) == success
    gate = Gate()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = held_stream(pool, app, gate)
        gate.wait_reached()
        ok(client.post("/areal_pause_generation", json={}))
        gate.open()
        assert finish_reason(running.result(timeout=10)) == "abort"
    first, second = FAKE_LAYOUT
    assert ok(client.post("/areal_set_update_weight_meta", json=areal_meta([first]))) == success
    assert app.engine.received == []  # announced, not received
    assert ok(client.post("/areal_update_weights_xccl", json={})) == success
    assert ok(client.post("/areal_set_update_weight_meta", json=areal_meta([second]))) == success
    assert ok(client.post("/areal_update_weights_xccl", json={})) == success
    assert app.engine.received == [first, second]
    assert app.engine.paused  # AReaL's hold outlives the update
    ok(client.post("/areal_continue_generation", json={}))
    assert not app.engine.paused
    assert ok(client.get("/weight_info"))["state"] == "whole"


def test_areal_two_step_refusals(fast_control: FastApp) -> None:
    """Each announcement is received once; a meta naming no open group, or unequal lists, is a
    400 that keeps the group; a misfit against the model is refused at the meta call and closes
    the group, since the trainer's broadcast follows whatever the server answers."""
    app = fast_control
    client = app.client
    first, second = FAKE_LAYOUT
    error = assert_error(client.post("/areal_update_weights_xccl", json={}), 400, "announced")
    assert error["param"] == "names"
    error = assert_error(
        client.post("/areal_set_update_weight_meta", json=areal_meta([first])), 400
    )
    assert error["param"] == "group_name"
    ok(client.post("/areal_init_weights_update_group", json=AREAL_GROUP))
    other = areal_meta([first], group_name="other")
    error = assert_error(client.post("/areal_set_update_weight_meta", json=other), 400)
    assert "'other'" in error["message"] and error["param"] == "group_name"
    unequal = {**areal_meta([first, second]), "shapes": [[8, 4]]}
    assert_error(client.post("/areal_set_update_weight_meta", json=unequal), 400, "same length")
    # A second announcement replaces the first (AReaL's worker keeps the last).
    ok(client.post("/areal_set_update_weight_meta", json=areal_meta([first])))
    ok(client.post("/areal_set_update_weight_meta", json=areal_meta([second])))
    ok(client.post("/areal_update_weights_xccl", json={}))
    assert app.engine.received == [second]
    assert_error(client.post("/areal_update_weights_xccl", json={}), 400, "announced")
    assert app.engine.group is not None
    misfit = {**areal_meta([first]), "shapes": [[4, 8]]}
    error = assert_error(client.post("/areal_set_update_weight_meta", json=misfit), 400)
    assert "the group is closed" in error["message"]
    assert app.engine.group is None and app.engine.received == [second]
    assert_error(client.post("/areal_update_weights_xccl", json={}), 400, "announced")
    assert ok(client.get("/weight_info"))["state"] == "whole"


# AReaL's factor names: FSDPEngine's named_parameters of the PEFT model (trainable ones only).
AREAL_FACTORS = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": [4, 8],
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight": [8, 4],
}


def areal_lora_meta(
    lora_int_id: int, lora_name: str = "default_lora-v1", group_name: str = "areal-group"
) -> dict[str, Any]:
    """vllm_remote.py, build_distributed_weight_update_requests with ``use_lora``: the payload
    of both requests (``get_versioned_lora_name``, FSDPEngine's ``peft_config``)."""
    return {
        "names": list(AREAL_FACTORS),
        "dtypes": ["float32"] * len(AREAL_FACTORS),
        "shapes": list(AREAL_FACTORS.values()),
        "group_name": group_name,
        "lora_name": lora_name,
        "lora_int_id": lora_int_id,
        "lora_target_modules": ["q_proj"],
        "lora_rank": 4,
        "lora_alpha": 16,
        "lora_bias": "none",
        "base_model_name": "/models/base",
    }


def load_from_memory(app: FastApp, name: str) -> None:
    """An adapter loaded from a trainer's memory (SGLang's form), factors of ``AREAL_FACTORS``'
    module."""
    import base64

    import safetensors.torch
    import torch

    factors = {k.replace("default.", ""): torch.zeros(v) for k, v in AREAL_FACTORS.items()}
    body = {
        "serialized_named_tensors": [base64.b64encode(safetensors.torch.save(factors)).decode()],
        "load_format": "safetensors",
        "lora_name": name,
        "lora_config": {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj"]},
    }
    ok(app.client.post("/update_weights_from_tensor", json=body))


def test_areal_lora_two_step(fast_control: FastApp) -> None:
    """vllm_remote.py with ``use_lora``: ``/areal_set_update_weight_meta_lora`` then
    ``/areal_update_weights_lora_xccl`` (the same payload), after AReaL's pause. The adapter
    with vLLM's ``lora_int_id`` gets the factors (PEFT's ``default.`` dropped from their
    names, as AReaL's worker does) and is served under the new versioned name only. An id no
    adapter has is a 400 in vLLM's words that closes the group (the broadcast comes anyway);
    so is a name that is another adapter's; each announcement is received once."""
    app = fast_control
    client = app.client
    success = {"success": True, "message": "TP rank: 0 success\n"}
    load_from_memory(app, "default_lora-v0")
    load_from_memory(app, "other")
    ok(client.post("/areal_init_weights_update_group", json=AREAL_GROUP))
    unknown = client.post("/areal_set_update_weight_meta_lora", json=areal_lora_meta(10**9))
    error = assert_error(unknown, 400, f"LoRA adapter {10**9} not found. Available: [")
    assert error["param"] == "lora_int_id" and app.engine.group is None
    # The ids the registry gave, in load order (the session's app numbered earlier loads).
    v0, other = (int(i) for i in error["message"].split("[")[1].split("]")[0].split(", "))
    ok(client.post("/areal_init_weights_update_group", json=AREAL_GROUP))
    clash = areal_lora_meta(v0, lora_name="other")
    error = assert_error(client.post("/areal_set_update_weight_meta_lora", json=clash), 400)
    assert f"lora_int_id {other}" in error["message"] and app.engine.group is None

    ok(client.post("/areal_init_weights_update_group", json=AREAL_GROUP))
    ok(client.post("/areal_pause_generation", json={}))
    meta = areal_lora_meta(v0)
    assert ok(client.post("/areal_set_update_weight_meta_lora", json=meta)) == success
    assert ok(client.post("/areal_update_weights_lora_xccl", json=meta)) == success
    models = {m["id"] for m in ok(client.get("/v1/models"))["data"]}
    assert {"default_lora-v1", "other"} <= models and "default_lora-v0" not in models
    sources = list(app.engine.adapter_sources.values())
    assert set(sources[-1].tensors) == {k.replace("default.", "") for k in AREAL_FACTORS}
    assert app.engine.received == []  # no base weight written
    assert_error(client.post("/areal_update_weights_lora_xccl", json=meta), 400, "announced")
    # The next version: the same id, in place under its next name.
    meta = areal_lora_meta(v0, lora_name="default_lora-v2")
    ok(client.post("/areal_set_update_weight_meta_lora", json=meta))
    ok(client.post("/areal_update_weights_lora_xccl", json=meta))
    models = {m["id"] for m in ok(client.get("/v1/models"))["data"]}
    assert "default_lora-v2" in models and "default_lora-v1" not in models
    ok(client.post("/areal_continue_generation", json={}))


def test_areal_lora_misfit_is_refused(fast_control: FastApp) -> None:
    """A factor that is no LoRA factor is refused at the meta call (the group closed)."""
    app = fast_control
    client = app.client
    load_from_memory(app, "default_lora-v0")
    ok(client.post("/areal_init_weights_update_group", json=AREAL_GROUP))
    unknown = client.post("/areal_set_update_weight_meta_lora", json=areal_lora_meta(10**9))
    v0 = int(assert_error(unknown, 400)["message"].split("[")[1].split("]")[0])
    ok(client.post("/areal_init_weights_update_group", json=AREAL_GROUP))
    misfit = {**areal_lora_meta(v0), "names": ["model.layers.0.self_attn.q_proj.weight"] * 2}
    error = assert_error(client.post("/areal_set_update_weight_meta_lora", json=misfit), 400)
    assert "is not a LoRA factor" in error["message"] and "the group is closed" in error["message"]
    assert app.engine.group is None


def test_areal_announcement_ends_with_its_group(fast_control: FastApp) -> None:
    """Tensors announced over a group that closed are never received over the next one."""
    app = fast_control
    client = app.client
    ok(client.post("/areal_init_weights_update_group", json=AREAL_GROUP))
    ok(client.post("/areal_set_update_weight_meta", json=areal_meta(list(FAKE_LAYOUT))))
    ok(client.post("/destroy_weights_update_group"))
    ok(client.post("/areal_init_weights_update_group", json=AREAL_GROUP))
    assert_error(client.post("/areal_update_weights_xccl", json={}), 400, "announced")
    assert app.engine.received == []


def test_areal_broken_off_broadcast_leaves_the_server_up(fast_control: FastApp) -> None:
    """The trainer dies mid-broadcast of an xccl call: a 400, the group gone, generation
    refused until a complete update (the model holds some new tensors), the server up."""
    app = fast_control
    client = app.client
    ok(client.post("/areal_init_weights_update_group", json=AREAL_GROUP))
    ok(client.post("/areal_set_update_weight_meta", json=areal_meta(list(FAKE_LAYOUT))))
    app.engine.break_receive = True
    assert_error(client.post("/areal_update_weights_xccl", json={}), 400, "mid-broadcast")
    assert app.engine.group is None
    assert ok(client.get("/weight_info"))["state"] == "broken"
    assert client.get("/health").status_code == 200


# -- skyrl-train: /update_weights {names, dtypes, shapes} ---------------------------------------


def test_skyrl_train_vllm_update_weights(fast_control: FastApp) -> None:
    """remote_inference_engine.py, RemoteWeightLoader.load_weights with ``engine_backend
    "vllm"``: ``asdict(BroadcastWeightUpdateRequest)``, one tensor per call (broadcast_strategy.py,
    send_chunks), after ``/init_weight_update_communicator``; answered ``{"status": "ok"}`` as
    its vllm_server.py. Received and loaded at once (SGLang's batched form), no group name."""
    app = fast_control
    client = app.client
    first, second = FAKE_LAYOUT
    request = {"names": [first], "dtypes": ["float32"], "shapes": [list(FAKE_LAYOUT[first])]}
    error = assert_error(client.post("/update_weights", json=request), 400, "no weight-transfer")
    assert error["param"] == "group_name"
    init_info = {"master_addr": "127.0.0.1", "master_port": 29500, "rank_offset": 1}
    init_info |= {"world_size": 2, "group_name": "skyrl", "backend": "gloo"}
    ok(client.post("/init_weight_update_communicator", json=init_info))
    assert ok(client.post("/update_weights", json=request)) == {"status": "ok"}
    request = {"names": [second], "dtypes": ["float32"], "shapes": [list(FAKE_LAYOUT[second])]}
    assert ok(client.post("/update_weights", json=request)) == {"status": "ok"}
    assert app.engine.received == [first, second]
    assert not app.engine.paused  # each call's own pause ended with it
    # One form per body; unequal lists are a 400 before anything is received.
    both = {**request, "weight_dir": "/tmp"}
    assert assert_error(client.post("/update_weights", json=both), 400)["param"] == "names"
    unequal = {**request, "dtypes": []}
    assert_error(client.post("/update_weights", json=unequal), 400, "same length")
    assert app.engine.received == [first, second] and app.engine.group is not None


# -- atropos' vLLM server body on /generate -----------------------------------------------------


def test_atropos_generate_answers_its_servers_shape(fast_control: FastApp) -> None:
    """vllm_server.py, VLLMServer._tokens_and_logprobs_completion_wrapper: the body, and how
    it reads the answer (the first key of ``item[0]`` is the sampled token)."""
    app = fast_control
    app.engine.script = lambda *_: [5, 6, EOS]
    request_data = {"prompt": {"prompt_token_ids": PROMPT}, "logprobs": 0}
    request_data.update({"n": 2, "max_tokens": 8, "temperature": 1.0, "top_p": 1.0})
    results = ok(app.client.post("/generate", json=request_data))
    assert set(results) == {
        "text",
        "prompt",
        "finish_reasons",
        "logprobs",
        "prompt_token_ids",
        "token_ids",
    }
    assert len(results["text"]) == 2 and results["prompt_token_ids"] == PROMPT
    for output_token_logprobs, finish_reason, ids in zip(
        results["logprobs"], results["finish_reasons"], results["token_ids"], strict=True
    ):
        # atropos' own two lines, as written.
        logprobs = [list(item[0].values())[0] for item in output_token_logprobs]  # noqa: RUF015
        output_ids = [int(list(item[0].keys())[0]) for item in output_token_logprobs]  # noqa: RUF015
        assert output_ids == ids == [5, 6, EOS] and finish_reason == "stop"
        assert all(isinstance(lp, float) for lp in logprobs)
    # Without logprobs, as that server: text, prompt and finish reasons only.
    plain = ok(app.client.post("/generate", json={"prompt": {"prompt_token_ids": PROMPT}}))
    assert set(plain) == {"text", "prompt", "finish_reasons"}


def test_atropos_get_logprobs_reads_prompt_logprobs(fast_control: FastApp) -> None:
    """vllm_server.py, VLLMServer._get_logprobs_wrapper: ``prompt_logprobs`` per position."""
    request_data: dict[str, Any] = {"prompt": {"prompt_token_ids": PROMPT}}
    request_data["prompt_logprobs"] = 2
    request_data.update({"n": 1, "temperature": 0.0, "top_p": 1.0, "max_tokens": 1})
    results = ok(fast_control.client.post("/generate", json=request_data))
    entries = results["prompt_logprobs"]
    assert len(entries) == len(PROMPT) and entries[0] is None
    for token_id, entry in zip(PROMPT[1:], entries[1:], strict=True):
        assert str(token_id) in entry and all(isinstance(v, float) for v in entry.values())


def test_generate_tells_the_bodies_apart(fast_control: FastApp) -> None:
    """SGLang's body keeps SGLang's answer; the vLLM server's refuses what it does not serve."""
    client = fast_control.client
    sglang = ok(client.post("/generate", json={"input_ids": PROMPT}))
    assert {"text", "output_ids", "meta_info"} <= set(sglang)
    unknown = {"prompt": {"prompt_token_ids": PROMPT}, "best_of_words": 3}
    assert_error(client.post("/generate", json=unknown), 400, "best_of_words")
    streamed = {"prompt": {"prompt_token_ids": PROMPT}, "stream": True}
    assert_error(client.post("/generate", json=streamed), 400, "stream: not served")
    text = {"prompt": "Hello"}
    assert assert_error(client.post("/generate", json=text), 400)["param"] == "prompt"
