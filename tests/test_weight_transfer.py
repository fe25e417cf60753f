"""Weights without disk, end to end on SmolLM2 over gloo on 127.0.0.1, under either engine: a
real trainer process (one optimizer step) broadcasting to two servers through
``tokenwire.client``; vLLM's and SGLang's protocol driven by hand with the bodies TRL and SkyRL
send; a trainer killed mid-broadcast; the refusals; and vLLM's fused layers. A trainer that
broadcasts other tensors than it named (larger, smaller, another dtype, NaN) is refused while
the server and its requests go on, on vLLM's form and on the frameworks' own (skyrl-train's
vLLM server, AReaL's two steps). Every test leaves ``rl_server`` with the base weights."""

from __future__ import annotations

import base64
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.conftest import (
    API_KEY,
    RL_SERVER_ARGS,
    SESSION_ENGINE,
    Server,
    _start,
    assert_error,
    free_port,
)
from tests.test_rl_control import PROMPT, Stream, ok, raw_logprobs, trainer_model
from tokenwire.assets import prepare
from tokenwire.weight_transfer import broadcast, dtype_name, join_group, leave_group, pack

GREEDY = {"temperature": 0, "max_tokens": 8, "logprobs": 0}


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return prepare("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def second_rl_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """A second server like ``rl_server``: the fleet of the trainer test (it ends after that
    test, not with the module: on vLLM it is a KV cache and three processes)."""
    yield from _start(tmp_path_factory, "rl-second", RL_SERVER_ARGS, API_KEY, request)


@pytest.fixture
def rl(rl_server: Server) -> Iterator[httpx.Client]:
    with rl_server.client() as client:
        yield client


@pytest.fixture(scope="module")
def prompt_ids(rl_server: Server) -> list[int]:
    with rl_server.client() as client:
        return ok(client.post("/tokenize", json={"messages": PROMPT}))["tokens"]


def greedy(client: httpx.Client, ids: list[int]) -> dict:
    body = {"token_ids": ids, "sampling_params": GREEDY}
    return ok(client.post("/inference/v1/generate", json=body))["choices"][0]


def generate_status(client: httpx.Client, ids: list[int]) -> httpx.Response:
    return client.post("/inference/v1/generate", json={"token_ids": ids, "sampling_params": GREEDY})


def assert_parity(choice: dict, model_dir: Path, prompt: list[int]) -> None:
    """Greedy ids and logprobs equal a transformers forward of ``model_dir``'s weights."""
    model = trainer_model(model_dir)
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=len(choice["token_ids"]),
            do_sample=False,
        )[0, len(prompt) :].tolist()
    assert choice["token_ids"] == expected
    got = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    want = raw_logprobs(model_dir, prompt, choice["token_ids"])
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-4


class Trainer:
    """The test itself as rank 0 (what TRL's and SkyRL's trainers do), for a one-server group."""

    def __init__(self, group_name: str | None = "weight_update_group") -> None:
        """``group_name`` None: the group as the trainer's default (vLLM's bodies name none)."""
        self.group_name = group_name
        self.port = free_port()
        self.group: Any = None

    def join(self, post: Callable[[], httpx.Response]) -> httpx.Response:
        """``post`` (the server's init call) and this process's join, at once."""
        answer: dict[str, httpx.Response] = {}
        thread = threading.Thread(target=lambda: answer.setdefault("r", post()))
        thread.start()
        self.group = join_group(
            master_address="127.0.0.1",
            master_port=self.port,
            rank=0,
            world_size=2,
            backend="gloo",
            group_name=self.group_name,
            timeout_s=30,
        )
        thread.join()
        return answer["r"]

    def send(self, post: Callable[[], httpx.Response], tensors: list[torch.Tensor]) -> Any:
        """``post`` (an update call) while broadcasting ``tensors``; its JSON answer."""
        return ok(self.post_while(post, tensors))

    def post_while(
        self, post: Callable[[], httpx.Response], tensors: list[torch.Tensor]
    ) -> httpx.Response:
        """``post`` while broadcasting ``tensors``, as far as the server takes them (a server
        that closed the group makes the next broadcast fail); its answer."""
        answer: dict[str, httpx.Response] = {}
        thread = threading.Thread(target=lambda: answer.setdefault("r", post()))
        thread.start()
        try:
            for tensor in tensors:
                broadcast(tensor, self.group)
        except RuntimeError:
            pass
        thread.join()
        return answer["r"]

    def leave(self) -> None:
        leave_group(self.group)


def base_params(base_dir: Path) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in trainer_model(base_dir).named_parameters()]


def update_info(params: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    return {
        "names": [n for n, _ in params],
        "dtype_names": [dtype_name(p.dtype) for _, p in params],
        "shapes": [list(p.shape) for _, p in params],
    }


# A second vLLM server costs a minute of CI's 30; the fleet's rendezvous (ranks, one broadcast to
# both) is the frontend's, the same on either engine, and vLLM's worker joining a trainer's group
# runs in the other tests here.
@pytest.mark.hf_only
def test_a_trainer_process_updates_two_servers(
    rl_server: Server,
    second_rl_server: Server,
    base_dir: Path,
    prompt_ids: list[int],
    tmp_path: Path,
) -> None:
    """One optimizer step, broadcast once to both servers through ``WeightSender``: a request
    held by its pause(keep) finishes, and the first token after the update carries the new
    version; greedy ids and logprobs of both equal a forward of the trainer's weights."""
    servers = [rl_server, second_rl_server]
    for server in servers:
        with server.client() as client:
            ok(client.post("/update_weight_version", json={"new_version": "default"}))
    trained = tmp_path / "trained"
    command = [sys.executable, "-m", "tests.weight_trainer", "step", str(base_dir)]
    command += [str(trained), "step-1", API_KEY, *(s.url for s in servers)]
    trainer = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout is not None and trainer.stdin is not None
        assert trainer.stdout.readline().strip() == "ready"
        held = Stream(rl_server, prompt_ids, max_tokens=24, ignore_eos=True)
        held.wait_for_tokens(2)
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        assert trainer.stdout.readline().strip() == "sent"
        assert trainer.wait(60) == 0
    finally:
        trainer.kill()
    final = held.final()
    assert final["finish_reason"] == "length"
    assert len(held.tokens()) == 24
    versions = [span["version"] for span in final["weight_versions"]]
    assert versions == ["default", "step-1"]  # frozen, then continued with the new weights
    for server in servers:
        with server.client() as client:
            assert ok(client.get("/weight_info"))["weight_version"] == "step-1"
            choice = greedy(client, prompt_ids)
            assert choice["weight_versions"] == [{"version": "step-1", "start": 0, "end": 8}]
            assert_parity(choice, trained, prompt_ids)
            # back to the base weights for the tests that follow (a disk reload)
            client.post("/update_weights", json={"weight_dir": str(base_dir)}).raise_for_status()


@pytest.mark.vllm_only  # on the hf engine: make test-frameworks' plain trainer, with a held request
def test_a_plain_torch_trainer_updates_the_server(
    rl_server: Server, rl: httpx.Client, base_dir: Path, prompt_ids: list[int], tmp_path: Path
) -> None:
    """``init_process_group`` + ``dist.broadcast`` in a trainer process with no tokenwire code
    (vLLM 0.33's bodies over plain HTTP): vLLM's worker joins as a member of the trainer's
    default group, and after the update its logprobs equal a forward of the trained weights."""
    trained = tmp_path / "trained"
    command = [sys.executable, "-m", "tests.weight_trainer", "torch", str(base_dir)]
    command += [str(trained), "torch-1", API_KEY, rl_server.url]
    trainer = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert "sent" in trainer.stdout, trainer.stderr[-3000:]
    assert ok(rl.get("/weight_info"))["weight_version"] == "torch-1"
    choice = greedy(rl, prompt_ids)
    assert choice["weight_versions"] == [{"version": "torch-1", "start": 0, "end": 8}]
    assert_parity(choice, trained, prompt_ids)
    ok(rl.post("/update_weights", json={"weight_dir": str(base_dir)}))
    assert_parity(greedy(rl, prompt_ids), base_dir, prompt_ids)


def test_trl_bodies_packed_and_skyrl_bodies(
    rl_server: Server, rl: httpx.Client, base_dir: Path, prompt_ids: list[int]
) -> None:
    """TRL 1.16: /server_info's weight_transfer_config, init with ``packed`` in init_info
    (several chunks), pause(keep), start, update, finish with a version, resume. skyrl-train
    0.3.1 (SGLang's names): init_weights_update_group, both update_weights_from_distributed
    body forms, destroy. Each sends the base weights: outputs stay the base model's."""
    info = ok(rl.get("/server_info", params={"config_format": "json"}))
    assert info["vllm_config"]["weight_transfer_config"]["backend"] == "gloo"
    assert ok(rl.get("/get_world_size")) == {"world_size": 1}
    params = base_params(base_dir)
    trainer = Trainer(None)  # TRL names no group: the server joins as its default group
    init_info = {"master_address": "127.0.0.1", "master_port": trainer.port, "rank_offset": 1}
    init_info |= {"world_size": 2, "packed": True, "packed_buffer_size_bytes": 50_000_000}
    answer = trainer.join(
        lambda: rl.post("/init_weight_transfer_engine", json={"init_info": init_info})
    )
    assert ok(answer) == {"message": "Weight transfer initialized"}
    assert ok(rl.post("/pause", params={"mode": "keep"})) == {"status": "paused"}
    assert ok(rl.post("/start_weight_update")) == {"message": "Weight update started"}
    from tokenwire.weight_transfer import TensorMeta, packed_chunks

    metas = [TensorMeta(n, p.dtype, tuple(p.shape)) for n, p in params]
    by_name = dict(params)
    chunks = [pack([by_name[m.name] for m in chunk]) for chunk in packed_chunks(metas, 50_000_000)]
    assert len(chunks) > 3
    body = {"update_info": update_info(params)}
    assert trainer.send(lambda: rl.post("/update_weights", json=body), chunks) == {
        "message": "Weights updated"
    }
    finish = rl.post("/finish_weight_update", json={"weight_version": "trl-1"})
    assert ok(finish) == {"message": "Weight update finished"}
    ok(rl.post("/resume"))
    assert ok(rl.get("/weight_info"))["weight_version"] == "trl-1"
    # An older client's packed flag in update_info, and vLLM's per-rank list, one broadcast
    # per tensor; empty lists repeat the previous update's tensors.
    ok(rl.post("/start_weight_update"))
    first = {**update_info(params[:3]), "packed": False}
    tensors = [p for _, p in params]
    trainer.send(lambda: rl.post("/update_weights", json={"update_info": [first]}), tensors[:3])
    empty = {"names": [], "dtype_names": [], "shapes": [], "packed": False}
    trainer.send(lambda: rl.post("/update_weights", json={"update_info": empty}), tensors[:3])
    rest = {**update_info(params[3:]), "packed": False}
    trainer.send(lambda: rl.post("/update_weights", json={"update_info": rest}), tensors[3:])
    ok(rl.post("/finish_weight_update"))  # no version: it stays
    assert ok(rl.get("/weight_info"))["weight_version"] == "trl-1"
    assert not ok(rl.get("/is_paused"))["is_paused"]  # start paused, finish resumed
    assert ok(rl.post("/shutdown_weight_transfer_engine")) == {
        "message": "Weight transfer shut down"
    }
    trainer.leave()

    skyrl = Trainer("skyrl")
    group = {"master_address": "127.0.0.1", "master_port": skyrl.port, "rank_offset": 1}
    group |= {"world_size": 2, "group_name": "skyrl", "backend": "gloo"}
    answer = skyrl.join(lambda: rl.post("/init_weights_update_group", json=group))
    assert ok(answer)["success"] is True
    last = len(params) - 2  # all but the last two in one call, those in the older form
    batch = {
        "names": [n for n, _ in params[:last]],
        "dtypes": [str(p.dtype) for _, p in params[:last]],
        "shapes": [list(p.shape) for _, p in params[:last]],
        "group_name": "skyrl",
        "flush_cache": True,
    }
    post = lambda body: lambda: rl.post("/update_weights_from_distributed", json=body)  # noqa: E731
    assert skyrl.send(post(batch), tensors[:last])["success"] is True
    for name, param in params[last:]:
        one = {"name": name, "dtype": "float32", "shape": list(param.shape), "group_name": "skyrl"}
        skyrl.send(post({**one, "weight_version": "skyrl-1"}), [param])
    assert ok(rl.get("/weight_info"))["weight_version"] == "skyrl-1"
    assert ok(rl.post("/destroy_weights_update_group", json={"group_name": "skyrl"}))["success"]
    skyrl.leave()
    assert_parity(greedy(rl, prompt_ids), base_dir, prompt_ids)


def test_update_weights_from_tensor_takes_safetensors_never_pickles(
    rl: httpx.Client, base_dir: Path, prompt_ids: list[int]
) -> None:
    """SGLang's tensors in the body: base64 safetensors load at once (a misfit or NaN is a 400
    and generation goes on); SGLang's default pickles are refused, never unpickled."""
    from safetensors.torch import save

    name, param = base_params(base_dir)[-1]
    entry = base64.b64encode(save({name: param.contiguous()})).decode()
    body = {"serialized_named_tensors": [entry], "load_format": "safetensors"}
    assert ok(rl.post("/update_weights_from_tensor", json=body))["success"] is True
    pickled = {"serialized_named_tensors": [entry]}
    error = assert_error(rl.post("/update_weights_from_tensor", json=pickled), 400, "pickles")
    assert error["param"] == "load_format"
    misfit = base64.b64encode(save({name: param[:2].contiguous()})).decode()
    body = {"serialized_named_tensors": [misfit], "load_format": "safetensors"}
    assert_error(rl.post("/update_weights_from_tensor", json=body), 400, "shape")
    poisoned = param.clone()
    poisoned.view(-1)[0] = float("nan")
    nan = base64.b64encode(save({name: poisoned.contiguous()})).decode()
    body = {"serialized_named_tensors": [nan], "load_format": "safetensors"}
    assert_error(rl.post("/update_weights_from_tensor", json=body), 400, "NaN or infinite")
    assert_parity(greedy(rl, prompt_ids), base_dir, prompt_ids)  # the old weights stay


def test_a_trainer_killed_mid_broadcast_then_a_complete_update(
    rl_server: Server, rl: httpx.Client, base_dir: Path, prompt_ids: list[int]
) -> None:
    """The server answers the cut-off update with a clear 400 (not hung). The hf engine had
    copied none of the call into the model: the weights stay whole. Under vLLM the update is
    taken as broken: generation and /resume are refused until a complete update mends it."""
    command = [sys.executable, "-m", "tests.weight_trainer", "die", str(base_dir), "-", "-"]
    command += [API_KEY, rl_server.url]
    trainer = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert "dying" in trainer.stdout, trainer.stderr[-3000:]
    # The server notices the closed connection on its own (well within the group's timeout).
    deadline = time.monotonic() + 30
    while "in progress" in rl.post("/resume").text:
        assert time.monotonic() < deadline, "the cut-off update never ended"
        time.sleep(0.1)
    if SESSION_ENGINE["kind"] == "vllm":
        error = assert_error(generate_status(rl, prompt_ids), 503, "weights are not whole")
        assert "broke off" in error["message"]
        assert_error(rl.post("/resume"), 400, "not whole")
    else:
        assert ok(rl.get("/weight_info"))["state"] == "whole"
        assert_parity(greedy(rl, prompt_ids), base_dir, prompt_ids)
    # a complete update, by a new trainer
    params = base_params(base_dir)
    trainer_rank = Trainer(None)
    init_info = {"master_address": "127.0.0.1", "master_port": trainer_rank.port}
    init_info |= {"rank_offset": 1, "world_size": 2}
    ok(
        trainer_rank.join(
            lambda: rl.post("/init_weight_transfer_engine", json={"init_info": init_info})
        )
    )
    ok(rl.post("/start_weight_update"))
    body = {"update_info": update_info(params)}
    trainer_rank.send(lambda: rl.post("/update_weights", json=body), [p for _, p in params])
    ok(rl.post("/finish_weight_update", json={"weight_version": "mended"}))
    ok(rl.post("/shutdown_weight_transfer_engine"))
    trainer_rank.leave()
    ok(rl.post("/resume"))  # the dead trainer's own pause(keep)
    choice = greedy(rl, prompt_ids)
    assert choice["weight_versions"][0]["version"] == "mended"
    assert_parity(choice, base_dir, prompt_ids)


def test_refusals(
    rl_server: Server, rl: httpx.Client, base_dir: Path, prompt_ids: list[int]
) -> None:
    """Out of order, malformed or misfit: a 400 naming why, nothing left running; a finish
    with weights missing refuses generation until a checkpoint reload."""
    names = {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[49152, 576]]}
    assert_error(rl.post("/update_weights", json={"update_info": names}), 400, "not initialised")
    assert_error(rl.post("/finish_weight_update"), 400, "without a matching start")
    bad = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2, "world_size": 2}
    assert_error(
        rl.post("/init_weight_transfer_engine", json={"init_info": bad}), 400, "rank_offset"
    )
    nccl = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    sglang = {**nccl, "backend": "nccl"}
    assert_error(
        rl.post("/init_weights_update_group", json=sglang), 400, "backends that work here: gloo"
    )
    lengths = {**names, "shapes": []}
    assert_error(rl.post("/update_weights", json={"update_info": lengths}), 400, "`shapes` should")

    trainer = Trainer(None)
    init_info = {**nccl, "master_port": trainer.port}
    ok(trainer.join(lambda: rl.post("/init_weight_transfer_engine", json={"init_info": init_info})))
    assert_error(
        rl.post("/update_weights", json={"update_info": names}), 400, "start_weight_update"
    )
    ok(rl.post("/start_weight_update"))
    assert_error(rl.post("/start_weight_update"), 400, "already active")
    misfit = {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[4, 4]]}
    error = assert_error(
        rl.post("/update_weights", json={"update_info": misfit}),
        400,
        "none of these tensors loaded",
    )
    assert "(49152, 576)" in error["message"]
    assert not ok(rl.get("/is_paused"))["is_paused"]  # the update's pause is lifted
    trainer.leave()

    # A finish with weights missing: generation waits for a checkpoint reload.
    trainer = Trainer(None)
    init_info = {**nccl, "master_port": trainer.port}
    ok(trainer.join(lambda: rl.post("/init_weight_transfer_engine", json={"init_info": init_info})))
    ok(rl.post("/start_weight_update"))
    name, param = base_params(base_dir)[0]
    one = {"names": [name], "dtype_names": ["float32"], "shapes": [list(param.shape)]}
    trainer.send(lambda: rl.post("/update_weights", json={"update_info": one}), [param])
    assert_error(rl.post("/finish_weight_update"), 400, "were not sent")
    assert_error(generate_status(rl, prompt_ids), 503, "without")
    ok(rl.post("/shutdown_weight_transfer_engine"))
    trainer.leave()
    reload = {"weight_dir": str(base_dir), "weight_version": "reloaded"}
    assert ok(rl.post("/update_weights", json=reload))["weight_version"] == "reloaded"
    assert_parity(greedy(rl, prompt_ids), base_dir, prompt_ids)


def test_a_fused_layer_loads_once_all_its_tensors_came(
    rl: httpx.Client, base_dir: Path, prompt_ids: list[int]
) -> None:
    """vLLM fuses q/k/v into one layer and its reload rebuilds a layer from what it is given:
    under --engine vllm a tensor of such a layer sent alone (SGLang's one-tensor form) waits in
    the worker until the others came, rather than leaving k and v unset."""
    if SESSION_ENGINE["kind"] != "vllm":
        pytest.skip("the hf engine loads each tensor as it comes")
    params = dict(base_params(base_dir))
    attention = "model.layers.0.self_attn."
    skyrl = Trainer("skyrl")
    group = {"master_address": "127.0.0.1", "master_port": skyrl.port, "rank_offset": 1}
    group |= {"world_size": 2, "group_name": "skyrl", "backend": "gloo"}
    assert ok(skyrl.join(lambda: rl.post("/init_weights_update_group", json=group)))["success"]

    def send(name: str, tensor: torch.Tensor) -> None:
        body = {"name": name, "dtype": "float32", "shape": list(tensor.shape)}
        body["group_name"] = "skyrl"
        post = lambda: rl.post("/update_weights_from_distributed", json=body)  # noqa: E731
        assert skyrl.send(post, [tensor])["success"] is True

    base = greedy(rl, prompt_ids)
    send(attention + "q_proj.weight", torch.zeros_like(params[attention + "q_proj.weight"]))
    assert greedy(rl, prompt_ids) == base  # q waits for k and v
    for part in ("k_proj", "v_proj"):
        send(attention + f"{part}.weight", params[attention + f"{part}.weight"])
    changed = greedy(rl, prompt_ids)  # now the zeroed q is in
    got = [entry["logprob"] for entry in changed["logprobs"]["content"]]
    want = [entry["logprob"] for entry in base["logprobs"]["content"]]
    assert changed["token_ids"] != base["token_ids"] or got != want
    assert ok(rl.post("/destroy_weights_update_group", json={"group_name": "skyrl"}))["success"]
    skyrl.leave()
    ok(rl.post("/update_weights", json={"weight_dir": str(base_dir)}))
    assert_parity(greedy(rl, prompt_ids), base_dir, prompt_ids)


# The trainer names ``announced`` and broadcasts ``sent`` (name, dtype) in their place; what the
# 400 says. A larger broadcast is gloo's abort (in the group's own process), a shorter one
# the sentinel at the buffer's end, NaN the values check.
NORM = "model.layers.0.input_layernorm.weight"  # 576 values
QUERY = "model.layers.0.self_attn.q_proj.weight"  # 576 x 576
MISSENT = {
    "larger": ([NORM, QUERY], [QUERY, NORM], "more bytes than announced"),
    "smaller": ([QUERY, NORM], [NORM, QUERY], f"{QUERY} (announced float32"),
    "bfloat16 for float32": ([NORM], [(NORM, torch.bfloat16)], "fewer bytes came"),
    "float32 for bfloat16": ([(NORM, torch.bfloat16)], [NORM], "more bytes than announced"),
    "NaN": ([NORM], [(NORM, "nan")], f"{NORM} holds NaN"),
}


@pytest.mark.parametrize("case", list(MISSENT))
def test_a_trainer_that_sends_other_tensors_than_it_named(
    case: str, rl_server: Server, rl: httpx.Client, base_dir: Path, prompt_ids: list[int]
) -> None:
    """A 400 naming what was wrong; the server alive, streams started before the update
    finish, the weights the base's (the call never reached the model); after gloo's abort
    a new group takes a complete update."""
    if SESSION_ENGINE["kind"] == "vllm" and case == "float32 for bfloat16":
        pytest.skip("on vLLM's worker the same abort as 'larger' (CI's 30 minutes)")
    params = dict(base_params(base_dir))
    announced, sent, message = MISSENT[case]
    streams = [Stream(rl_server, prompt_ids, max_tokens=16, ignore_eos=True) for _ in range(3)]
    for stream in streams:
        stream.wait_for_tokens(1)
    trainer = Trainer(None)
    init_info = {"master_address": "127.0.0.1", "master_port": trainer.port}
    init_info |= {"rank_offset": 1, "world_size": 2}
    ok(trainer.join(lambda: rl.post("/init_weight_transfer_engine", json={"init_info": init_info})))
    ok(rl.post("/start_weight_update"))  # pause(keep): the streams freeze
    metas = [_tensor(params, entry) for entry in announced]
    body = {"update_info": update_info(metas)}
    answer = trainer.post_while(
        lambda: rl.post("/update_weights", json=body), [_tensor(params, e)[1] for e in sent]
    )
    error = assert_error(answer, 400, message)
    assert "the group is closed" in error["message"]
    trainer.leave()
    assert rl.get("/health").status_code == 200
    assert ok(rl.get("/weight_info"))["state"] == "whole"
    assert not ok(rl.get("/is_paused"))["is_paused"]  # the refused update lifted its pause
    for stream in streams:
        assert stream.final()["finish_reason"] == "length" and len(stream.tokens()) == 16
    assert_parity(greedy(rl, prompt_ids), base_dir, prompt_ids)
    if case != "larger":
        return  # every refusal closes the group alike; the abort (its process killed) shows
    # a complete update over a new group
    trainer = Trainer(None)
    init_info["master_port"] = trainer.port
    ok(trainer.join(lambda: rl.post("/init_weight_transfer_engine", json={"init_info": init_info})))
    ok(rl.post("/start_weight_update"))
    body = {"update_info": update_info(list(params.items()))}
    trainer.send(lambda: rl.post("/update_weights", json=body), list(params.values()))
    ok(rl.post("/finish_weight_update", json={"weight_version": f"after {case}"}))
    ok(rl.post("/shutdown_weight_transfer_engine"))
    trainer.leave()
    choice = greedy(rl, prompt_ids)
    assert choice["weight_versions"][0]["version"] == f"after {case}"
    assert_parity(choice, base_dir, prompt_ids)


def _tensor(
    params: dict[str, torch.Tensor], entry: str | tuple[str, Any]
) -> tuple[str, torch.Tensor]:
    """A base weight by name, or (name, dtype) cast, or (name, "nan") all NaN."""
    name, kind = (entry, None) if isinstance(entry, str) else entry
    tensor = params[name]
    if kind == "nan":
        return name, torch.full_like(tensor, float("nan"))
    return name, tensor if kind is None else tensor.to(kind)


def test_the_framework_forms_refuse_a_missent_tensor_and_take_a_complete_update(
    rl_server: Server, rl: httpx.Client, base_dir: Path, prompt_ids: list[int]
) -> None:
    """skyrl-train's vLLM form (``/update_weights {names, dtypes, shapes}``) and AReaL's two
    steps (``/areal_set_update_weight_meta``, ``/areal_update_weights_xccl``) receive through
    the path SGLang's form does: a trainer that broadcasts other bytes than it announced gets a
    400, the server stays up, a stream in flight finishes, the base weights stay. Then AReaL's
    two steps carry a complete update, each bucket announced and received in turn."""
    # The larger broadcast: gloo's abort, in the group's process (the hf engine's, or the one
    # vLLM's worker starts), never in the engine.
    case = "larger"
    params = dict(base_params(base_dir))
    announced, sent, message = MISSENT[case]
    named = [_tensor(params, entry) for entry in announced]
    missent = [_tensor(params, entry)[1] for entry in sent]
    # skyrl-train's BroadcastWeightUpdateRequest, AReaL's meta: the same lists.
    lists = {
        "names": [name for name, _ in named],
        "dtypes": [dtype_name(t.dtype) for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
    }
    base = greedy(rl, prompt_ids)  # the base weights' answer (every test leaves them)
    stream = Stream(rl_server, prompt_ids, max_tokens=16, ignore_eos=True)
    stream.wait_for_tokens(1)
    skyrl = Trainer("skyrl")
    init_info = {"master_addr": "127.0.0.1", "master_port": skyrl.port, "rank_offset": 1}
    init_info |= {"world_size": 2, "group_name": "skyrl", "backend": "gloo"}
    ok(skyrl.join(lambda: rl.post("/init_weight_update_communicator", json=init_info)))
    answer = skyrl.post_while(lambda: rl.post("/update_weights", json=lists), missent)
    assert "the group is closed" in assert_error(answer, 400, message)["message"]
    skyrl.leave()
    assert stream.final()["finish_reason"] == "length" and len(stream.tokens()) == 16

    areal = Trainer("update_weight_group")
    group = {"master_address": "127.0.0.1", "master_port": str(areal.port), "rank_offset": 1}
    group |= {"world_size": 2, "backend": "gloo", "group_name": "update_weight_group"}
    join = lambda: rl.post("/areal_init_weights_update_group", json=group)  # noqa: E731
    ok(areal.join(join))
    meta = {**lists, "group_name": "update_weight_group"}
    ok(rl.post("/areal_set_update_weight_meta", json=meta))
    xccl = lambda: rl.post("/areal_update_weights_xccl", json={})  # noqa: E731
    answer = areal.post_while(xccl, missent)
    assert "the group is closed" in assert_error(answer, 400, message)["message"]
    areal.leave()
    assert rl.get("/health").status_code == 200
    assert ok(rl.get("/weight_info"))["state"] == "whole"
    assert not ok(rl.get("/is_paused"))["is_paused"]
    assert_same_answer(greedy(rl, prompt_ids), base)

    areal = Trainer("update_weight_group")
    group["master_port"] = str(areal.port)
    ok(areal.join(join))
    ok(rl.post("/areal_pause_generation", json={}))
    items = list(params.items())
    half = len(items) // 2
    for bucket in (items[:half], items[half:]):
        tensors = dict(bucket)
        meta = {**update_info(bucket), "group_name": "update_weight_group"}
        meta["dtypes"] = meta.pop("dtype_names")
        ok(rl.post("/areal_set_update_weight_meta", json=meta))
        assert areal.send(xccl, list(tensors.values()))["success"] is True
    ok(rl.post("/update_weight_version", json={"new_version": "areal-two-step"}))
    ok(rl.post("/areal_continue_generation", json={}))
    ok(rl.post("/destroy_weights_update_group"))
    areal.leave()
    choice = greedy(rl, prompt_ids)
    assert choice["weight_versions"] == [{"version": "areal-two-step", "start": 0, "end": 8}]
    assert_same_answer(choice, base)  # it sent the base weights: nothing else came in


def assert_same_answer(choice: dict, base: dict) -> None:
    """The server's greedy answer is the one it gave on the base weights (ids, logprobs 1e-4):
    the weights are the base's, without another transformers forward."""
    assert choice["token_ids"] == base["token_ids"]
    got, want = ([entry["logprob"] for entry in c["logprobs"]["content"]] for c in (choice, base))
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-4
