"""The RL frameworks' own weight senders, run unmodified on CPU (gloo) against a real tokenwire
server: skyrl-train's ``BroadcastTransferStrategy``, AReaL's remote SGLang and vLLM engines (base
weights, and a LoRA adapter through the vLLM engine), and a plain ``init_process_group``
trainer (tokenwire's ``WeightSender`` is tested in the main suite, ``test_weight_transfer``).
Each sender is a trainer process (one AdamW step of SmolLM2, or of a LoRA adapter's factors)
that updates the server while a request is in flight; then the server's greedy ids and logprobs
equal a transformers (or PEFT) forward of the trained weights (1e-4), and every token names the
weights it came from. ``make test-frameworks`` installs the frameworks' wheels into
``.venv-frameworks``; elsewhere this module is skipped."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("skyrl_train", reason="the framework wheels: make test-frameworks")
pytest.importorskip("areal", reason="the framework wheels: make test-frameworks")

from tests.conftest import Server
from tests.frameworks.conftest import AREAL_LORA
from tests.test_rl_control import PROMPT, Stream, ok, trainer_model
from tests.test_weight_transfer import GREEDY, assert_parity, greedy
from tokenwire.assets import prepare

HELD_TOKENS = 24


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return prepare("smollm2-135m-instruct")


@pytest.fixture
def server(frameworks_server: Server, base_dir: Path) -> Iterator[httpx.Client]:
    """The server with the base weights, named "base", running: each trainer's step starts
    from them, so parity after an update shows the update came in."""
    with frameworks_server.client() as client:
        reload = {"weight_dir": str(base_dir), "weight_version": "base"}
        ok(client.post("/update_weights", json=reload))
        ok(client.post("/resume"))
        yield client


@pytest.fixture(scope="module")
def prompt_ids(frameworks_server: Server) -> list[int]:
    with frameworks_server.client() as client:
        return ok(client.post("/tokenize", json={"messages": PROMPT}))["tokens"]


class TrainerProcess:
    """A sender's process: ``ready`` once its group is formed, then it sends on ``go()``."""

    def __init__(self, module: str, *args: str) -> None:
        command = [sys.executable, "-m", module, *args]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None and self.process.stdin is not None
        self.stdin, self.stdout = self.process.stdin, self.process.stdout

    def __enter__(self) -> TrainerProcess:
        self.expect("ready")
        return self

    def expect(self, word: str) -> None:
        """Read up to ``word`` on a line of its own (AReaL logs to stdout too)."""
        for line in self.stdout:
            if line.strip() == word:
                return
        raise AssertionError(f"the trainer exited before {word!r}: {self.process.wait()}")

    def go(self) -> None:
        self.stdin.write("go\n")
        self.stdin.flush()

    def sent(self) -> None:
        self.expect("sent")
        assert self.process.wait(60) == 0

    def __exit__(self, *exc: object) -> None:
        self.process.kill()
        self.process.wait()


def assert_held_across(held: Stream, versions: list[str]) -> None:
    """The request frozen by the update's pause finished, its tokens named by the weights of
    each side: the old ones, then the new."""
    final = held.final()
    assert final["finish_reason"] == "length"
    assert len(held.tokens()) == HELD_TOKENS
    spans = final["weight_versions"]
    assert [span["version"] for span in spans] == versions
    assert spans[0]["start"] == 0 and spans[-1]["end"] == HELD_TOKENS
    assert all(a["end"] == b["start"] for a, b in itertools.pairwise(spans))


def assert_updated(client: httpx.Client, trained: Path, prompt: list[int], version: str) -> None:
    choice = greedy(client, prompt)
    assert choice["weight_versions"] == [{"version": version, "start": 0, "end": 8}]
    assert_parity(choice, trained, prompt)


def test_skyrl_train_broadcast_strategy(
    frameworks_server: Server,
    server: httpx.Client,
    base_dir: Path,
    prompt_ids: list[int],
    tmp_path: Path,
) -> None:
    """skyrl-train's remote engine of each backend and ``BroadcastWeightTransferSender``: its
    group ("skyrl"), one call per weight (SGLang's ``/update_weights_from_distributed {name,
    dtype, shape}`` without a group_name; its vLLM server's ``/update_weights {names, dtypes,
    shapes}`` after ``/init_weight_update_communicator``), and ``/destroy_weights_update_group``
    with no body. One trainer process (one step) sends both rounds, the base weights reloaded
    between them. skyrl-train neither pauses a remote engine nor names versions (its
    ``pause_generation`` aborts, which remote engines do not implement), nor reads the answers
    (a 400 would pass unseen): the test pauses (keep) and names the version, as an
    orchestrator would, and parity shows every weight came."""
    trained = tmp_path / "trained"
    address = f"127.0.0.1:{frameworks_server.port}"
    args = ("sglang,vllm", str(base_dir), str(trained), address)
    with TrainerProcess("tests.frameworks.skyrl_trainer", *args) as trainer:
        for backend in ("sglang", "vllm"):
            if backend != "sglang":
                reload = {"weight_dir": str(base_dir), "weight_version": "base"}
                ok(server.post("/update_weights", json=reload))
                trainer.expect("ready")
            version = f"skyrl-{backend}-1"
            held = Stream(frameworks_server, prompt_ids, max_tokens=HELD_TOKENS, ignore_eos=True)
            held.wait_for_tokens(2)
            ok(server.post("/pause", params={"mode": "keep"}))
            trainer.go()
            trainer.expect("sent")
            ok(server.post("/update_weight_version", json={"new_version": version}))
            ok(server.post("/resume"))
            assert_held_across(held, ["base", version])
            assert_updated(server, trained, prompt_ids, version)
        assert trainer.process.wait(60) == 0


def test_areal_remote_engines(
    frameworks_server: Server,
    server: httpx.Client,
    base_dir: Path,
    prompt_ids: list[int],
    tmp_path: Path,
) -> None:
    """AReaL's remote engines, one round each from one trainer process (one step), the base
    weights reloaded between them:

    - ``RemoteSGLangEngine``: ``/init_weights_update_group`` (the port a string),
      ``/pause_generation`` with no mode (SGLang's abort), one
      ``/update_weights_from_distributed`` per bucket, ``/continue_generation``;
    - ``RemotevLLMEngine``: its vLLM server's own routes, ``/areal_init_weights_update_group``,
      ``/areal_pause_generation`` (abort), per bucket ``/areal_set_update_weight_meta`` then
      ``/areal_update_weights_xccl`` while the trainer broadcasts,
      ``/areal_continue_generation``.

    A request in flight is aborted with its tokens so far, all of the old weights; AReaL
    resubmits prompt + those tokens (``agenerate``), and the continuation is the new
    weights'."""
    trained = tmp_path / "trained"
    address = f"127.0.0.1:{frameworks_server.port}"
    rounds = {"sglang": "areal-1", "vllm": "areal-vllm-1"}
    args = (",".join(rounds), str(base_dir), str(trained), address, ",".join(rounds.values()))
    with TrainerProcess("tests.frameworks.areal_trainer", *args) as trainer:
        for engine, version in rounds.items():
            if engine != "sglang":
                reload = {"weight_dir": str(base_dir), "weight_version": "base"}
                ok(server.post("/update_weights", json=reload))
                trainer.expect("ready")
            held = Stream(frameworks_server, prompt_ids, max_tokens=500, ignore_eos=True)
            held.wait_for_tokens(2)
            trainer.go()
            trainer.expect("sent")
            final, partial = held.final(), held.tokens()
            assert final["finish_reason"] == "abort"  # AReaL's pause aborts
            assert 2 <= len(partial) < 500
            assert final["weight_versions"] == [
                {"version": "base", "start": 0, "end": len(partial)}
            ]
            assert not ok(server.get("/is_paused"))["is_paused"]
            assert_updated(server, trained, prompt_ids + partial, version)
        assert trainer.process.wait(60) == 0


def test_a_plain_init_process_group_trainer(
    frameworks_server: Server,
    server: httpx.Client,
    base_dir: Path,
    prompt_ids: list[int],
    tmp_path: Path,
) -> None:
    """``init_process_group`` + ``dist.broadcast`` and vLLM's four phases over plain HTTP:
    ``start_weight_update`` pauses (keep), ``finish_weight_update`` names the version and
    resumes."""
    trained = tmp_path / "trained"
    args = (str(base_dir), str(trained), "plain-1", frameworks_server.url)
    with TrainerProcess("tests.frameworks.plain_trainer", *args) as trainer:
        held = Stream(frameworks_server, prompt_ids, max_tokens=HELD_TOKENS, ignore_eos=True)
        held.wait_for_tokens(2)
        trainer.go()
        trainer.sent()
    assert_held_across(held, ["base", "plain-1"])
    assert_updated(server, trained, prompt_ids, "plain-1")


def lora_greedy(client: httpx.Client, model: str, ids: list[int]) -> httpx.Response:
    body = {"model": model, "token_ids": ids, "sampling_params": GREEDY}
    return client.post("/inference/v1/generate", json=body)


def peft_forward(base_dir: Path, adapter: Path, prompt: list[int], output: list[int]) -> tuple:
    """A trainer's view of ``output`` under a PEFT model of ``adapter`` on the base: one full
    forward over prompt + output, its argmax at each output position (greedy's ids, given
    the same prefix) and the log-softmax of each output token."""
    import torch
    from peft import PeftModel

    model = PeftModel.from_pretrained(trainer_model(base_dir), adapter).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    argmax = logprobs.argmax(dim=-1).tolist()
    return argmax, [logprobs[i, t].item() for i, t in enumerate(output)]


def test_areal_lora_two_step(
    frameworks_server: Server,
    server: httpx.Client,
    base_dir: Path,
    areal_initial_lora: Path,
    prompt_ids: list[int],
    tmp_path: Path,
) -> None:
    """AReaL's LoRA training with ``RemotevLLMEngine`` (``use_lora``, xccl): the server started
    with AReaL's initial adapter as ``default_lora-v0`` (lora_int_id 1); the trainer's one
    AdamW step of the factors goes out as ``/areal_set_update_weight_meta_lora`` then
    ``/areal_update_weights_lora_xccl`` (AReaL's bodies: the trainable PEFT parameters, their
    ``peft_config``), and the adapter is served as ``default_lora-v1``, the old name gone, with
    a PEFT forward's ids and logprobs (1e-4). A request under v0 in flight is aborted (AReaL's
    pause). Then a second round whose ``lora_rank`` does not fit its factors: refused (400)
    before a byte is received, the server alive and v1 served as it was."""
    trained = tmp_path / "trained"
    address = f"127.0.0.1:{frameworks_server.port}"
    args = ("lora", str(base_dir), str(areal_initial_lora), str(trained), address, "4")
    with TrainerProcess("tests.frameworks.areal_trainer", *args) as trainer:
        held = Stream(frameworks_server, prompt_ids, model=AREAL_LORA, max_tokens=500)
        held.wait_for_tokens(2)
        trainer.go()
        trainer.expect("sent")
        final = held.final()
        assert final["finish_reason"] == "abort"  # AReaL's pause aborts
        assert len({span["version"] for span in final["weight_versions"]}) == 1
        models = [m["id"] for m in ok(server.get("/v1/models"))["data"]]
        assert "default_lora-v1" in models and AREAL_LORA not in models
        assert lora_greedy(server, AREAL_LORA, prompt_ids).status_code in (400, 404)
        choice = ok(lora_greedy(server, "default_lora-v1", prompt_ids))["choices"][0]
        argmax, want = peft_forward(base_dir, trained, prompt_ids, choice["token_ids"])
        assert choice["token_ids"] == argmax
        got = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-4
        # The step changed what the adapter serves (v0's lora_B is zero: the base model's).
        base = greedy(server, prompt_ids)["logprobs"]["content"]
        assert max(abs(a - b["logprob"]) for a, b in zip(got, base, strict=False)) > 1e-3

        trainer.go()  # lora_rank 4 announced for factors of r = 8
        trainer.expect("refused")
        error = trainer.stdout.readline()
        assert "400" in error and "/areal_set_update_weight_meta_lora" in error, error
        assert trainer.process.wait(60) == 0
    assert server.get("/health").status_code == 200
    ok(server.post("/areal_continue_generation", json={}))  # the trainer stopped paused
    again = ok(lora_greedy(server, "default_lora-v1", prompt_ids))["choices"][0]
    assert again["token_ids"] == choice["token_ids"]
    # Equal up to what the prefix cache's state changes (a prompt's KV cached or computed
    # afresh: 1e-5 was seen), which is PEFT's bound above.
    again_logprobs = [e["logprob"] for e in again["logprobs"]["content"]]
    assert max(abs(a - b) for a, b in zip(again_logprobs, got, strict=True)) <= 1e-4


def test_trl_vllm_client(
    frameworks_server: Server,
    server: httpx.Client,
    base_dir: Path,
    prompt_ids: list[int],
    tmp_path: Path,
) -> None:
    """TRL 1.16's ``VLLMClient`` unmodified (``tests.frameworks.trl_trainer``: gloo stand-ins
    for the two vLLM NCCL calls it makes): ``/server_info``, ``/get_world_size``,
    ``/init_weight_transfer_engine`` with ``packed``, then ``update_model_params``: start,
    one ``/update_weights`` of every parameter in vLLM's packed chunks, finish. TRL pauses
    nothing itself: ``start_weight_update`` freezes the request in flight (keep), and finish
    resumes it under the new weights."""
    pytest.importorskip("trl", reason="trl: make install-frameworks")
    trained = tmp_path / "trained"
    args = (str(base_dir), str(trained), frameworks_server.url)
    with TrainerProcess("tests.frameworks.trl_trainer", *args) as trainer:
        held = Stream(frameworks_server, prompt_ids, max_tokens=HELD_TOKENS, ignore_eos=True)
        held.wait_for_tokens(2)
        trainer.go()
        trainer.sent()
    # Frozen, not aborted: it finished whole. Its tokens all name "base": TRL's finish names
    # no version, and vLLM's finish then keeps the one served.
    final = held.final()
    assert final["finish_reason"] == "length" and len(held.tokens()) == HELD_TOKENS
    assert ok(server.get("/weight_info"))["weight_version"] == "base"
    assert_parity(greedy(server, prompt_ids), trained, prompt_ids)
