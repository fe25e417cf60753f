"""An RL training loop's shape end to end on SmolLM2: generate, pause in every mode with requests
in flight, reload perturbed weights, resume; versions on every token and trainer-parity logprobs
with the NEW weights, and what the hf engine does with bad weights and its prefix cache. The
control routes' shapes, bad input and SGLang's /generate are in ``test_fast_control`` and
``test_fast_sglang``."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import SESSION_ENGINE, Server
from tokenwire.assets import prepare

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def rl(rl_server: Server) -> Iterator[httpx.Client]:
    """The shared RL server, as a fresh one is: running, weights named "default"."""
    with rl_server.client() as client:
        assert client.post("/resume").status_code == 200
        assert client.post("/update_weight_version", json={"new_version": "default"}).is_success
        yield client


@pytest.fixture(scope="module")
def prompt_ids(rl: httpx.Client) -> list[int]:
    return rl.post("/tokenize", json={"messages": PROMPT}).json()["tokens"]


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return prepare("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def perturbed_dir(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture with seeded noise on every weight: a 'training step'."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02 * param.std())
    out = tmp_path_factory.mktemp("perturbed")
    model.save_pretrained(out)
    return out


@functools.cache
def trainer_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def raw_logprobs(model_dir: Path, prompt: list[int], output: list[int]) -> list[float]:
    """What a trainer computes: log-softmax of one full forward over prompt + output."""
    model = trainer_model(model_dir)
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [logprobs[start + i, token].item() for i, token in enumerate(output)]


def generate(client: httpx.Client, ids: list[int], **sampling: Any) -> httpx.Response:
    body = {"token_ids": ids, "sampling_params": {"temperature": 0, **sampling}}
    return client.post("/inference/v1/generate", json=body)


class Stream:
    """A streaming generate read on a thread: chunks as they come, then the final choice."""

    def __init__(
        self, server: Server, ids: list[int], *, model: str | None = None, **sampling: Any
    ) -> None:
        """``model``: a LoRA adapter's name (None: the base model)."""
        self.chunks: list[dict] = []
        self.done = threading.Event()
        body: dict[str, Any] = {
            "token_ids": ids,
            "stream": True,
            "sampling_params": {"temperature": 0, "logprobs": 0, **sampling},
        }
        if model is not None:
            body["model"] = model
        self.thread = threading.Thread(target=self._run, args=(server, body), daemon=True)
        self.thread.start()

    def _run(self, server: Server, body: dict) -> None:
        with (
            server.client() as client,
            client.stream("POST", "/inference/v1/generate", json=body) as response,
        ):
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(json.loads(line[6:]))
        self.done.set()

    def tokens(self) -> list[int]:
        return [t for c in self.chunks for ch in c["choices"] for t in ch["token_ids"]]

    def logprobs(self) -> list[float]:
        return [
            e["logprob"]
            for c in self.chunks
            for ch in c["choices"]
            for e in ch["logprobs"]["content"]
        ]

    def wait_for_tokens(self, count: int) -> None:
        deadline = time.monotonic() + 60
        while len(self.tokens()) < count:
            assert time.monotonic() < deadline and not self.done.is_set(), "stream stalled"
            time.sleep(0.02)

    def settled_count(self, quiet_s: float = 0.5) -> int:
        """Its token count once no chunk came for ``quiet_s``: after a pause, what was sent
        before it may still be on its way (a loaded machine delays it)."""
        count, since, deadline = len(self.tokens()), time.monotonic(), time.monotonic() + 30
        while time.monotonic() - since < quiet_s:
            assert time.monotonic() < deadline, "the stream never stopped"
            time.sleep(0.05)
            if len(self.tokens()) != count:
                count, since = len(self.tokens()), time.monotonic()
        return count

    def final(self) -> dict:
        assert self.done.wait(120), "stream did not end"
        return next(ch for c in self.chunks for ch in c["choices"] if ch["finish_reason"])


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json() if response.content else None


def test_pause_abort_ends_requests_in_flight(rl_server: Server, rl: httpx.Client) -> None:
    stream = Stream(rl_server, [1, 2, 3], max_tokens=500, ignore_eos=True)
    stream.wait_for_tokens(3)
    assert ok(rl.post("/pause", params={"mode": "abort"})) == {"status": "paused"}
    final = stream.final()
    assert final["finish_reason"] == "abort"
    assert 3 <= len(stream.tokens()) < 500  # the partial tokens were kept
    assert ok(rl.get("/is_paused")) == {"is_paused": True}
    refused = generate(rl, [1, 2, 3], max_tokens=2)
    assert refused.status_code == 503 and "paused" in refused.json()["error"]["message"]
    assert ok(rl.post("/resume")) == {"status": "resumed"}
    assert ok(rl.get("/is_paused")) == {"is_paused": False}
    assert len(ok(generate(rl, [1, 2, 3], max_tokens=2))["choices"][0]["token_ids"]) == 2


def test_pause_wait_lets_requests_finish(rl_server: Server, rl: httpx.Client) -> None:
    stream = Stream(rl_server, [1, 2, 3], max_tokens=12, ignore_eos=True)
    stream.wait_for_tokens(1)
    assert ok(rl.post("/pause", params={"mode": "wait"})) == {"status": "paused"}
    # /pause answered once the request in flight had finished, normally.
    assert stream.final()["finish_reason"] == "length"
    assert len(stream.tokens()) == 12
    assert generate(rl, [1, 2, 3], max_tokens=2).status_code == 503
    ok(rl.post("/resume"))


def test_concurrent_wait_pauses_are_all_answered(rl_server: Server, rl: httpx.Client) -> None:
    """The engine answers every caller pausing (wait) while a request drains, not the last."""
    stream = Stream(rl_server, [1, 2, 3], max_tokens=12, ignore_eos=True)
    stream.wait_for_tokens(1)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        pausing = [pool.submit(rl.post, "/pause", params={"mode": "wait"}) for _ in range(3)]
        answers = [ok(p.result(timeout=120)) for p in pausing]
    assert answers == [{"status": "paused"}] * 3
    assert stream.final()["finish_reason"] == "length" and len(stream.tokens()) == 12
    ok(rl.post("/resume"))
    # Drained while nothing runs: answered at once.
    assert ok(rl.post("/pause", params={"mode": "wait"})) == {"status": "paused"}
    ok(rl.post("/resume"))


def test_pause_keep_freezes_and_continues_unchanged(rl_server: Server, rl: httpx.Client) -> None:
    reference = ok(generate(rl, [1, 2, 3], max_tokens=16, ignore_eos=True))["choices"][0]
    stream = Stream(rl_server, [1, 2, 3], max_tokens=16, ignore_eos=True)
    stream.wait_for_tokens(2)
    ok(rl.post("/pause", params={"mode": "keep"}))
    frozen = stream.settled_count()
    # A new request queues instead of being refused, and nothing moves while paused.
    queued = Stream(rl_server, [4, 5, 6], max_tokens=4, ignore_eos=True)
    deadline = time.monotonic() + 60
    while ok(rl.get("/get_load"))["load"] < 2:  # the engine holds both: it queued
        assert time.monotonic() < deadline, "the new request never reached the engine"
        time.sleep(0.05)
    time.sleep(0.5)
    assert len(stream.tokens()) == frozen and not queued.chunks
    ok(rl.post("/resume"))
    assert stream.final()["finish_reason"] == "length"
    assert stream.tokens() == reference["token_ids"]
    assert stream.final()["weight_versions"] == [{"version": "default", "start": 0, "end": 16}]
    # The queued request may still be running when the first ends: wait for its end first.
    assert queued.final()["finish_reason"] == "length" and len(queued.tokens()) == 4


def test_training_loop_reload_versions_and_parity(
    rl_server: Server,
    rl: httpx.Client,
    prompt_ids: list[int],
    base_dir: Path,
    perturbed_dir: Path,
) -> None:
    """generate -> pause(keep, clear_cache) mid-request -> load new weights -> resume."""
    assert ok(rl.get("/weight_info"))["weight_version"] == "default"
    stream = Stream(rl_server, prompt_ids, max_tokens=24, ignore_eos=True)
    stream.wait_for_tokens(4)
    ok(rl.post("/pause", params={"mode": "keep", "clear_cache": "true"}))
    before = stream.settled_count()
    loaded = ok(
        rl.post(
            "/update_weights", json={"weight_dir": str(perturbed_dir), "weight_version": "step-1"}
        )
    )
    assert loaded == {"success": True, "weight_version": "step-1"}
    assert ok(rl.get("/weight_info"))["weight_version"] == "step-1"
    ok(rl.post("/resume"))
    final = stream.final()
    output = stream.tokens()
    assert final["weight_versions"] == [
        {"version": "default", "start": 0, "end": before},
        {"version": "step-1", "start": before, "end": 24},
    ]
    # Tokens sampled after the reload recomputed their KV with the new weights: a trainer's
    # forward with the NEW weights gives the same logprobs.
    new = raw_logprobs(perturbed_dir, prompt_ids, output)
    old = raw_logprobs(base_dir, prompt_ids, output)
    served = stream.logprobs()
    assert max(abs(a - b) for a, b in zip(served[before:], new[before:], strict=True)) <= 1e-4
    assert max(abs(a - b) for a, b in zip(served[:before], old[:before], strict=True)) <= 1e-4
    # A fresh request after the reload: one version, parity with the new weights.
    fresh = ok(generate(rl, prompt_ids, max_tokens=8, logprobs=0))["choices"][0]
    assert fresh["weight_versions"] == [{"version": "step-1", "start": 0, "end": 8}]
    # Every logprob entry is the union of both clients' shapes.
    entry = fresh["logprobs"]["content"][0]
    assert entry["token"] == f"token_id:{entry['token_id']}" and entry["rank"] >= 1
    assert entry["top_logprobs"][0]["token_id"] == entry["token_id"]
    fresh_lps = [e["logprob"] for e in fresh["logprobs"]["content"]]
    expected = raw_logprobs(perturbed_dir, prompt_ids, fresh["token_ids"])
    assert max(abs(a - b) for a, b in zip(fresh_lps, expected, strict=True)) <= 1e-4
    # Back to the base weights (SGLang's name), so later tests see the original model.
    restored = ok(
        rl.post(
            "/update_weights_from_disk",
            json={"model_path": str(base_dir), "weight_version": "default"},
        )
    )
    assert restored["success"] is True and restored["num_paused_requests"] == 0
    assert ok(rl.get("/model_info"))["weight_version"] == "default"


def test_bad_weights_are_refused_and_the_old_ones_stay(rl: httpx.Client, tmp_path: Path) -> None:
    before = ok(generate(rl, [1, 2, 3], max_tokens=6))["choices"][0]["token_ids"]
    other = prepare("qwen3-tiny")  # another architecture
    for weight_dir in (str(tmp_path / "missing"), str(tmp_path), str(other)):
        refused = rl.post("/update_weights", json={"weight_dir": weight_dir})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["message"].startswith("weights not loaded")
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint")
    assert rl.post("/update_weights", json={"weight_dir": str(tmp_path)}).status_code == 400
    assert ok(generate(rl, [1, 2, 3], max_tokens=6))["choices"][0]["token_ids"] == before
    assert ok(rl.get("/weight_info"))["weight_version"] == "default"


def test_nonfinite_weights_are_a_400(rl: httpx.Client, base_dir: Path, tmp_path: Path) -> None:
    before = ok(generate(rl, [1, 2, 3], max_tokens=6))["choices"][0]["token_ids"]
    tensors = load_file(base_dir / "model.safetensors")
    tensors["model.norm.weight"] = torch.full((576,), float("nan"))
    save_file(tensors, tmp_path / "model.safetensors")
    refused = rl.post("/update_weights", json={"weight_dir": str(tmp_path)})
    assert refused.status_code == 400, refused.text
    assert "model.norm.weight holds NaN or infinite values" in refused.json()["error"]["message"]
    assert ok(generate(rl, [1, 2, 3], max_tokens=6))["choices"][0]["token_ids"] == before


def test_a_reload_that_fails_after_its_first_file(
    rl: httpx.Client, base_dir: Path, tmp_path: Path
) -> None:
    """A checkpoint in two files, the second holding NaN. The hf engine reads every file before
    it swaps a weight: a 400, the old weights serve. vLLM's worker loads file by file, so the
    first file's layers are new: a 400 that says so, and generation is refused until a
    checkpoint loads whole."""
    before = ok(generate(rl, [1, 2, 3], max_tokens=6))["choices"][0]["token_ids"]
    tensors = load_file(base_dir / "model.safetensors")
    names = sorted(tensors)  # model.norm.weight sorts into the second half
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, tmp_path / "model-00001-of-00002.safetensors")
    second = {n: tensors[n] for n in names[half:]}
    second["model.norm.weight"] = torch.full((576,), float("nan"))
    save_file(second, tmp_path / "model-00002-of-00002.safetensors")
    refused = rl.post("/update_weights", json={"weight_dir": str(tmp_path)})
    assert refused.status_code == 400, refused.text
    assert "model.norm.weight holds NaN or infinite values" in refused.text
    after = generate(rl, [1, 2, 3], max_tokens=6)
    if SESSION_ENGINE["kind"] == "hf":
        assert ok(after)["choices"][0]["token_ids"] == before
        return
    assert "broke off" in refused.text
    assert after.status_code == 503 and "checkpoint reload broke off" in after.text, after.text
    ok(rl.post("/update_weights", json={"weight_dir": str(base_dir), "weight_version": "default"}))
    assert ok(generate(rl, [1, 2, 3], max_tokens=6))["choices"][0]["token_ids"] == before


def test_a_checkpoint_rewritten_during_a_reload_is_a_400_not_a_crash(
    rl_server: Server, rl: httpx.Client, base_dir: Path, tmp_path: Path
) -> None:
    """A trainer truncating and rewriting the checkpoint while the server loads it: was a
    SIGBUS that killed the server (safetensors mapped the file; the copy came later)."""
    path = tmp_path / "model.safetensors"
    shutil.copy(base_dir / "model.safetensors", path)
    size = path.stat().st_size
    with path.open("rb") as handle:
        header_end = 8 + int.from_bytes(handle.read(8), "little")
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            os.truncate(path, header_end)  # the tensors' bytes gone, the header intact
            os.truncate(path, size)  # full size again, zeros
            stop.wait(0.02)  # mostly whole, so the old loader mapped it

    rewriter = threading.Thread(target=churn)
    rewriter.start()
    statuses = []
    try:
        for step in range(4):
            version = ok(rl.get("/weight_info"))["weight_version"]
            body = {"weight_dir": str(tmp_path), "weight_version": f"churn-{step}"}
            answer = rl.post("/update_weights", json=body)
            statuses.append(answer.status_code)
            assert answer.status_code in (200, 400), answer.text
            if answer.status_code == 400:  # the old weights stay
                assert ok(rl.get("/weight_info"))["weight_version"] == version
    finally:
        stop.set()
        rewriter.join()
    assert rl_server.process.poll() is None and rl.get("/health").status_code == 200
    assert 400 in statuses, statuses
    restored = rl.post(
        "/update_weights_from_disk", json={"model_path": str(base_dir), "weight_version": "default"}
    )
    assert ok(restored)["success"] is True


def test_a_choice_ending_on_a_stop_string_keeps_its_weight_version(
    rl_server: Server, rl: httpx.Client, prompt_ids: list[int]
) -> None:
    """The cut at a stop string keeps the version that sampled every kept token."""
    free = ok(generate(rl, prompt_ids, max_tokens=8, ignore_eos=True))["choices"][0]
    stop = ok(rl.post("/detokenize", json={"tokens": free["token_ids"][2:4]}))["prompt"]
    ok(rl.post("/update_weight_version", json={"new_version": "v7"}))
    try:
        sampling = {"max_tokens": 8, "ignore_eos": True, "stop": [stop]}
        whole = ok(generate(rl, prompt_ids, **sampling))["choices"][0]
        streamed = Stream(rl_server, prompt_ids, **sampling).final()
        sglang = {"max_new_tokens": 8, "stop": [stop], "ignore_eos": True, "temperature": 0}
        body = {"input_ids": prompt_ids, "sampling_params": sglang}
        meta = ok(rl.post("/generate", json=body))["meta_info"]
    finally:
        ok(rl.post("/update_weight_version", json={"new_version": "default"}))
    count = len(whole["token_ids"])
    assert whole["finish_reason"] == "stop" and whole["stop_reason"] == stop and count <= 4
    assert whole["weight_versions"] == [{"version": "v7", "start": 0, "end": count}]
    assert streamed["finish_reason"] == "stop"
    assert streamed["weight_versions"] == whole["weight_versions"]
    assert meta["finish_reason"] == {"type": "stop", "matched": stop}
    assert meta["weight_versions"] == whole["weight_versions"]


@pytest.mark.hf_only  # vLLM's blocks are 128 tokens on CPU
def test_reset_and_reloads_clear_the_prefix_cache(rl: httpx.Client, base_dir: Path) -> None:
    """No KV computed before ``/reset_prefix_cache`` or a weight reload serves a later request
    (the reload keeps the base weights, so only the cache can tell)."""
    prompt = [(7 * i) % 30000 + 500 for i in range(100)]

    def cached() -> int:
        usage = ok(generate(rl, prompt, max_tokens=2))["usage"]
        return usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)

    assert cached() == 0
    assert cached() == 96
    assert ok(rl.post("/reset_prefix_cache")) == {"success": True}
    assert cached() == 0
    assert cached() == 96
    ok(rl.post("/update_weights_from_disk", json={"model_path": str(base_dir)}))
    assert cached() == 0
    ok(rl.post("/update_weight_version", json={"new_version": "default"}))
