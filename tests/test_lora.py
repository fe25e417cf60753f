"""LoRA adapters in PEFT's format: read and checked, then served per row against PEFT itself."""

from __future__ import annotations

import contextlib
import functools
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import (
    API_KEY,
    LORA_TARGETS,
    SESSION_ENGINE,
    Server,
    assert_error,
    smollm2_float32,
)
from tokenwire import adapter_files
from tokenwire.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from tokenwire.engine.base import WeightsError
from tokenwire.engine.hf.lora import AdapterSlots

pytestmark = pytest.mark.model
SMOLLM2 = Path.home() / ".cache/tokenwire/models/smollm2-135m-instruct"


def _base() -> torch.nn.Module:
    return smollm2_float32(SMOLLM2)


@functools.cache
def _reference(path: Path | None) -> torch.nn.Module:
    """The trainer's model: the base, or PEFT's model of an adapter (each built once)."""
    from peft import PeftModel

    return _base() if path is None else PeftModel.from_pretrained(_base(), path).eval()


def _peft_logits(path: Path | None, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return _reference(path)(input_ids=ids).logits


@pytest.mark.hf_only
def test_mixed_batch_matches_peft(lora_adapters: list[Path]) -> None:
    """Base + three adapters in one forward: each row equals PEFT's forward of its adapter."""
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1345, 28, 30]] * 4)
    model = _base()
    slots = AdapterSlots(model, max_loras=4, max_rank=16)
    for slot, path in enumerate(lora_adapters, start=1):
        slots.put(slot, slots.read(path))
    slots.rows = torch.tensor([0, 1, 2, 3])
    with torch.inference_mode():
        served = model(input_ids=ids).logits
    # References in the same batch shape: CPU GEMMs of other shapes alone differ by ~1e-4.
    reference = [_peft_logits(None, ids)[0]]
    reference += [_peft_logits(p, ids)[row] for row, p in enumerate(lora_adapters, start=1)]
    for row, expected in enumerate(reference):
        logprobs = torch.log_softmax(served[row], -1)
        assert (logprobs - torch.log_softmax(expected, -1)).abs().max() <= 1e-4
    assert (served[1] - served[0]).abs().max() > 1e-2  # the adapter changes the output

    slots.clear(2)
    with torch.inference_mode():
        cleared = model(input_ids=ids).logits
    assert torch.allclose(cleared[2], served[0], atol=1e-5)  # slot 2 serves the base again


@pytest.mark.hf_only
def test_qwen3_batch_matches_peft(tmp_path: Path) -> None:
    """The same on qwen3-tiny (its q/k norms and tied embeddings): base and adapter rows of one
    batch equal PEFT's forward."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from tokenwire.assets import prepare

    qwen3 = prepare("qwen3-tiny")

    def load() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()

    torch.manual_seed(3)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS[1] + LORA_TARGETS[2])
    config.init_lora_weights = False
    get_peft_model(load(), config).save_pretrained(tmp_path)
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1345, 28, 30]] * 2)
    model = load()
    slots = AdapterSlots(model, max_loras=1, max_rank=8)
    slots.put(1, slots.read(tmp_path))
    slots.rows = torch.tensor([0, 1])
    with torch.inference_mode():
        served = torch.log_softmax(model(input_ids=ids).logits, -1)
        base = torch.log_softmax(load()(input_ids=ids).logits[0], -1)
        adapted = PeftModel.from_pretrained(load(), tmp_path).eval()(input_ids=ids).logits[1]
    assert (served[0] - base).abs().max() <= 1e-4
    assert (served[1] - torch.log_softmax(adapted, -1)).abs().max() <= 1e-4
    assert (served[1] - served[0]).abs().max() > 1e-3


def _write(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    (path / CONFIG_FILE).write_text(json.dumps(config))
    save_file(tensors, path / WEIGHTS_FILE)
    return path


@pytest.mark.hf_only
def test_bad_adapters_are_refused(tmp_path: Path, lora_adapters: list[Path]) -> None:
    model = _base()
    slots = AdapterSlots(model, max_loras=2, max_rank=8)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    good = {f"{q}.lora_A.weight": torch.zeros(4, 576), f"{q}.lora_B.weight": torch.zeros(576, 4)}
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8}
    cases = {
        "missing": (tmp_path / "nowhere", "not a directory"),
        "rank": (lora_adapters[2], "above --max-lora-rank 8"),
        "target": (
            _write(
                tmp_path / "target",
                config,
                {k.replace("q_proj", "rotary"): v for k, v in good.items()},
            ),
            "not a linear of the model",
        ),
        "shape": (
            _write(tmp_path / "shape", config, {**good, f"{q}.lora_A.weight": torch.zeros(4, 100)}),
            "has shape (4, 100)",
        ),
        "nan": (
            _write(
                tmp_path / "nan",
                config,
                {**good, f"{q}.lora_B.weight": torch.full((576, 4), float("nan"))},
            ),
            "NaN or infinite",
        ),
        "dora": (_write(tmp_path / "dora", {**config, "use_dora": True}, good), "use_dora"),
        # PEFT's LoRA of parameters (its form for a MoE model's fused experts)
        "parameters": (
            _write(
                tmp_path / "parameters", {**config, "target_parameters": ["q_proj.weight"]}, good
            ),
            "target_parameters=['q_proj.weight'] is not supported",
        ),
        # NaN alpha loaded and served every token at -9999; a huge one overflows B.
        "alpha": (
            _write(tmp_path / "alpha", {**config, "lora_alpha": float("nan")}, good),
            "NaN is not a finite number",
        ),
        "overflow": (
            _write(
                tmp_path / "overflow",
                {**config, "lora_alpha": 1e29},
                {**good, f"{q}.lora_B.weight": torch.full((576, 4), 1e20)},
            ),
            "overflows",
        ),
        "no_weights": (_write(tmp_path / "empty", config, {"x": torch.zeros(1)}), "lora_A"),
    }
    for name, (path, message) in cases.items():
        with pytest.raises(WeightsError, match=re.escape(message)):
            slots.read(path)
        assert slots.nbytes == 0, name  # nothing was installed
    # PEFT writes target_parameters: [] into every adapter's config.
    assert (
        slots.read(_write(tmp_path / "plain", {**config, "target_parameters": []}, good)).rank == 4
    )


# --- served over HTTP: a real server with LoRA on ----------------------------------------------

PROMPT = [1, 504, 3458, 314, 260, 1345, 28, 30, 2683, 314, 253, 1789]
# 256 cached tokens on either engine: 16 blocks of 16 (hf), 2 of 128 (vLLM's CPU default).
LONG_PROMPT = list(range(1000, 1260))


def _generate(server: Server, model: str | None, ids: list[int], **sampling: Any) -> dict:
    body: dict[str, Any] = {
        "token_ids": ids,
        "sampling_params": {"temperature": 0, "max_tokens": 6, "logprobs": 0, **sampling},
    }
    if model is not None:
        body["model"] = model
    with server.client() as client:
        response = client.post("/inference/v1/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _trainer_logprobs(path: Path | None, prompt: list[int], output: list[int]) -> list[float]:
    """A trainer's view: one PEFT (or base) forward over prompt + output."""
    logits = _peft_logits(path, torch.tensor([prompt + output]))[0]
    logprobs = torch.log_softmax(logits.float(), -1)
    start = len(prompt) - 1
    return [logprobs[start + i, t].item() for i, t in enumerate(output)]


def _load(server: Server, name: str, path: Path, **extra: Any) -> Any:
    with server.client() as client:
        return client.post(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra}
        )


def test_adapters_served_in_one_batch_equal_peft(
    lora_server: Server, lora_adapters: list[Path]
) -> None:
    """Base and three adapters at once: each answer's logprobs equal a PEFT forward of its ids,
    and each token names its adapter's version."""
    for i, path in enumerate(lora_adapters[1:], start=1):
        response = _load(lora_server, f"a{i}", path)
        assert response.status_code == 200, response.text
        assert response.text == f"Success: LoRA adapter 'a{i}' added successfully."
    models = [None, "a0", "a1", "a2"] * 2
    with ThreadPoolExecutor(len(models)) as pool:
        answers = list(pool.map(lambda m: _generate(lora_server, m, PROMPT), models))
    outputs = {}
    for model, answer in zip(models, answers, strict=True):
        choice = answer["choices"][0]
        ids = choice["token_ids"]
        outputs.setdefault(model, ids)
        assert ids == outputs[model]  # the same greedy ids whoever shared the batch
        path = None if model is None else lora_adapters[int(model[1])]
        served = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        expected = _trainer_logprobs(path, PROMPT, ids)
        assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) <= 1e-4
        version = "default" if model is None else f"{model}@{int(model[1]) + 1}"
        assert [span["version"] for span in choice["weight_versions"]] == [version]
    assert len({tuple(ids) for ids in outputs.values()}) > 1  # adapters change the answer

    with lora_server.client() as client:
        listed = client.get("/v1/models").json()["data"]
    cards = {card["id"]: card for card in listed}
    assert cards["a2"]["parent"] == "smollm2-135m-instruct"
    assert cards["a2"]["root"] == str(lora_adapters[2])


def test_chunked_prefill_runs_under_its_adapter(
    lora_server: Server, lora_adapters: list[Path]
) -> None:
    """A prompt longer than one prefill forward (64 tokens here) is chunked: every chunk runs
    through the request's adapter, beside a base-model stream."""
    prompt = [(7 * t) % 3000 + 100 for t in range(150)]
    with ThreadPoolExecutor(2) as pool:
        base = pool.submit(_generate, lora_server, None, PROMPT, max_tokens=30)
        answer = _generate(lora_server, "a0", prompt)
        base.result()
    choice = answer["choices"][0]
    served = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    expected = _trainer_logprobs(lora_adapters[0], prompt, choice["token_ids"])
    assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) <= 1e-4


def _cached_tokens(server: Server, model: str | None) -> int:
    usage = _generate(server, model, LONG_PROMPT, max_tokens=1)["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_prefix_cache_never_crosses_adapters(
    lora_server: Server, lora_adapters: list[Path]
) -> None:
    """KV cached under one adapter version (or the base) never serves another, even a version
    loaded in place from the same directory (a trainer that rewrites its files)."""
    seen = set()
    for model in ("a0", None, "a1", "a0", None):
        assert _cached_tokens(lora_server, model) == (256 if model in seen else 0), model
        seen.add(model)
    for load_inplace in (False, True):
        response = _load(lora_server, "again", lora_adapters[0], load_inplace=load_inplace)
        assert response.status_code == 200, response.text
        assert _cached_tokens(lora_server, "again") == 0
    with lora_server.client() as client:
        response = client.post("/v1/unload_lora_adapter", json={"lora_name": "again"})
        assert response.status_code == 200, response.text


class _Stream:
    """A streamed generate under ``model`` read on a thread; ``started`` once tokens came."""

    def __init__(self, server: Server, model: str) -> None:
        self.chunks: list[dict] = []
        self.started = threading.Event()
        self.error: str | None = None
        body = {
            "model": model,
            "token_ids": PROMPT,
            "stream": True,
            "sampling_params": {"temperature": 0, "max_tokens": 40, "ignore_eos": True},
        }
        self.thread = threading.Thread(target=self._run, args=(server, body), daemon=True)
        self.thread.start()

    def _run(self, server: Server, body: dict) -> None:
        with (
            server.client() as client,
            client.stream("POST", "/inference/v1/generate", json=body) as response,
        ):
            if response.status_code != 200:
                self.error = response.read().decode()
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(json.loads(line[6:]))
                    self.started.set()
        self.started.set()

    def versions(self) -> set[str]:
        return {
            span["version"]
            for chunk in self.chunks
            for choice in chunk["choices"]
            for span in choice.get("weight_versions") or ()
        }

    def tokens(self) -> list[int]:
        return [t for chunk in self.chunks for c in chunk["choices"] for t in c["token_ids"]]


def test_swap_and_unload_while_requests_run(lora_server: Server, lora_adapters: list[Path]) -> None:
    """An in-place swap and an unload while streams run: none fails, each keeps the version
    it started under, and later requests see the new version (or a 404)."""
    response = _load(lora_server, "swap", lora_adapters[0], weight_version="v1")
    assert response.status_code == 200, response.text
    streams = [_Stream(lora_server, "swap") for _ in range(3)]
    for stream in streams:
        assert stream.started.wait(600)
    response = _load(lora_server, "swap", lora_adapters[1], load_inplace=True, weight_version="v2")
    assert response.status_code == 200, response.text
    after = _generate(lora_server, "swap", PROMPT)
    assert after["choices"][0]["weight_versions"][0]["version"] == "v2"
    with lora_server.client() as client:
        unload = client.post("/v1/unload_lora_adapter", json={"lora_name": "swap"})
        assert unload.status_code == 200, unload.text
        gone = client.post(
            "/inference/v1/generate",
            json={"model": "swap", "token_ids": PROMPT, "sampling_params": {}},
        )
        assert gone.status_code == 404, gone.text
    # a0 is v1's adapter: greedy, a stream run under v1's weights to its end has a0's tokens.
    v1_tokens = _generate(lora_server, "a0", PROMPT, max_tokens=40, ignore_eos=True)
    for stream in streams:
        stream.thread.join(600)
        assert stream.error is None, stream.error
        assert stream.tokens() == v1_tokens["choices"][0]["token_ids"]
        assert stream.versions() == {"v1"}  # the version it started under, to its end
    # The swapped-in version's logprobs equal PEFT's forward of that adapter.
    choice = after["choices"][0]
    served = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    expected = _trainer_logprobs(lora_adapters[1], PROMPT, choice["token_ids"])
    assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) <= 1e-4


def test_lora_bad_input(lora_server: Server, lora_adapters: list[Path], tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    with lora_server.client() as client:

        def load(**body: Any) -> Any:
            return client.post("/v1/load_lora_adapter", json=body)

        cases = [
            (load(lora_name="a0", lora_path=str(lora_adapters[1])), 400, "already been loaded"),
            (
                load(lora_name="x", lora_path=str(lora_adapters[0].parent / "none")),
                400,
                "directory",
            ),
            (load(lora_name="x", lora_path=str(outside)), 400, "--allowed-lora-paths"),
            (load(lora_name="smollm2-135m-instruct", lora_path=str(lora_adapters[0])), 400, "base"),
            (load(lora_name="x"), 400, "lora_path"),
            (client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}), 404, "nope"),
            (
                client.post(
                    "/inference/v1/generate",
                    json={"model": "nope", "token_ids": [1], "sampling_params": {}},
                ),
                404,
                "nope",
            ),
        ]
        for response, status, message in cases:
            assert response.status_code == status, response.text
            assert message in response.text
        sglang = client.post(
            "/load_lora_adapter", json={"lora_name": "a0", "lora_path": str(lora_adapters[0])}
        )
        assert sglang.status_code == 400
        assert sglang.json()["success"] is False
        assert "a0" in sglang.json()["loaded_adapters"]
        wrong = client.post("/generate", json={"input_ids": PROMPT, "lora_path": "nope"})
        assert wrong.status_code == 400
    # Nothing changed: a0 still serves.
    assert _generate(lora_server, "a0", PROMPT)["choices"][0]["token_ids"]


def test_hostile_adapter_files_are_refused(lora_server: Server, lora_adapters: list[Path]) -> None:
    """The red team's adapter directories inside --allowed-lora-paths: a symlink out of it, a
    small adapter padded to a 2 GiB sparse file (refused unread: the server's peak memory stays),
    a NaN alpha. Each is a 400 quoting no file bytes, and a0 still serves."""
    root = lora_adapters[0].parent
    secret = root.parent / "secret"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    linked = _copy(lora_adapters[0], root / "hostile-link")
    (linked / WEIGHTS_FILE).unlink()
    (linked / WEIGHTS_FILE).symlink_to(secret)
    sparse = _copy(lora_adapters[0], root / "hostile-sparse")
    with open(sparse / WEIGHTS_FILE, "r+b") as file:
        file.truncate(2 * 2**30)
    nan = _copy(lora_adapters[0], root / "hostile-nan")
    config = (nan / CONFIG_FILE).read_text()
    (nan / CONFIG_FILE).write_text(re.sub(r'"lora_alpha": \d+', '"lora_alpha": NaN', config))
    peak = _peak_rss(lora_server)
    cases = [
        (linked, "--allowed-lora-paths"),
        (sparse, "not what its header gives"),
        (nan, "NaN is not a finite number"),
    ]
    with lora_server.client() as client:
        for path, message in cases:
            body = {"lora_name": "hostile", "lora_path": str(path)}
            response = client.post("/v1/load_lora_adapter", json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]["message"]
            assert message in error
            assert "root" not in error.replace(str(root), "")
    assert _peak_rss(lora_server) - peak < 2**30
    assert _generate(lora_server, "a0", PROMPT)["choices"][0]["token_ids"]


def _copy(adapter: Path, path: Path) -> Path:
    path.mkdir()
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        (path / file).write_bytes((adapter / file).read_bytes())
    return path


def _peak_rss(server: Server) -> int:
    """The server process's peak resident memory, in bytes."""
    status = Path(f"/proc/{server.process.pid}/status")
    if not status.exists():
        pytest.skip("no /proc")
    line = next(x for x in status.read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def test_sglang_lora_path_names_the_adapter(lora_server: Server) -> None:
    ids = _generate(lora_server, "a0", PROMPT)["choices"][0]["token_ids"]
    with lora_server.client() as client:
        body = {
            "input_ids": PROMPT,
            "lora_path": "a0",
            "sampling_params": {"temperature": 0, "max_new_tokens": 6},
        }
        answer = client.post("/generate", json=body).json()
    assert answer["output_ids"] == ids


def test_skyrl_loads_in_place_by_name(lora_server: Server, lora_adapters: list[Path]) -> None:
    """SkyRL's RemoteInferenceClient.load_lora_adapter body, twice under one name: each call
    replaces the adapter in place (its trainer rewrites the files every step)."""
    with lora_server.client() as client:
        for path in lora_adapters[1:]:
            body = {"lora_name": "skyrl-policy", "lora_path": str(path)}
            response = client.post("/skyrl/v1/load_lora_adapter", json=body)
            assert response.status_code == 200, response.text
            assert response.text == "Success: LoRA adapter 'skyrl-policy' added successfully."
    choice = _generate(lora_server, "skyrl-policy", PROMPT)["choices"][0]
    served = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    last = lora_adapters[2]  # the last one loaded
    expected = _trainer_logprobs(last, PROMPT, choice["token_ids"])
    assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) <= 1e-4
    assert choice["weight_versions"][0]["version"].startswith("skyrl-policy@")
    _unload(lora_server, "skyrl-policy")


def _unload(server: Server, name: str) -> None:
    """Free the adapter's slots for the tests after (the server is the session's)."""
    with server.client() as client:
        response = client.post("/v1/unload_lora_adapter", json={"lora_name": name})
    assert response.status_code == 200, response.text


# --- adapters from a trainer's memory: no directory written by the trainer --------------------


def _peft_adapter(seed: int, targets: list[str], rank: int = 8) -> Any:
    """A trainer's PEFT model of SmolLM2 (random lora_B: the adapter changes the output)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    return get_peft_model(_base(), config).eval()


def _factors(peft_model: Any) -> dict[str, torch.Tensor]:
    """What a trainer sends: PEFT's own names and tensors of the adapter."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}


def _assert_serves(server: Server, model: str, reference: Path, version: str) -> None:
    """``model`` answers with a PEFT forward's logprobs of the adapter saved at ``reference``."""
    choice = _generate(server, model, PROMPT)["choices"][0]
    served = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    expected = _trainer_logprobs(reference, PROMPT, choice["token_ids"])
    assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) <= 1e-4
    assert [span["version"] for span in choice["weight_versions"]] == [version]


def _b64_safetensors(tensors: dict[str, torch.Tensor]) -> str:
    import base64

    from safetensors.torch import save

    return base64.b64encode(save(tensors)).decode()


def test_adapter_over_the_weight_transfer_group(lora_server: Server, tmp_path: Path) -> None:
    """A trainer's adapter over vLLM's four phases (``update_info.lora_name``), new and then in
    place, and over SGLang's ``/update_weights_from_distributed``: each version serves PEFT's
    logprobs; a stream of the first version finishes under it; a base stream is untouched."""
    from tokenwire.client import Client
    from tokenwire.client.weights import WeightSender
    from tokenwire.weight_transfer import broadcast, dtype_name

    trainer = _peft_adapter(10, ["q_proj", "v_proj"])
    trainer.save_pretrained(tmp_path / "step1")  # the reference only: the server never reads it
    sender = WeightSender([Client(lora_server.url, api_key=API_KEY)], timeout_s=30)
    sender.connect()
    try:
        config = trainer.peft_config["default"].to_dict()
        sender.send(_factors(trainer).items(), version="mem-1", lora_name="mem", lora_config=config)
        _assert_serves(lora_server, "mem", tmp_path / "step1", "mem-1")

        old, base = _Stream(lora_server, "mem"), _Stream(lora_server, "a0")
        assert old.started.wait(600) and base.started.wait(600)
        with torch.no_grad():  # the trainer's next step, as factors alone (config kept)
            for name, param in trainer.named_parameters():
                if "lora_B" in name:
                    param.mul_(-2)
        trainer.save_pretrained(tmp_path / "step2")
        sender.send(_factors(trainer).items(), version="mem-2", lora_name="mem")
        _assert_serves(lora_server, "mem", tmp_path / "step2", "mem-2")
        for stream, version in ((old, "mem-1"), (base, "a0@1")):
            stream.thread.join(600)
            assert stream.error is None, stream.error
            assert len(stream.tokens()) == 40
            assert stream.versions() == {version}

        # SGLang's one-call form over the same group: no pause, loaded as it comes.
        factors = _factors(_peft_adapter(11, ["q_proj", "v_proj"]))
        body = {
            "names": list(factors),
            "dtypes": [dtype_name(t.dtype) for t in factors.values()],
            "shapes": [list(t.shape) for t in factors.values()],
            "lora_name": "mem",
            "weight_version": "mem-3",
        }
        with ThreadPoolExecutor(1) as pool, lora_server.client() as client:
            answer = pool.submit(client.post, "/update_weights_from_distributed", json=body)
            for tensor in factors.values():
                broadcast(tensor, sender._group)
            response = answer.result()
        assert response.status_code == 200, response.text
        reference = tmp_path / "step3"
        adapter_files.write(reference, json.loads(json.dumps(config, default=sorted)), factors)
        _assert_serves(lora_server, "mem", reference, "mem-3")

        # A misfit inside vLLM's phases: refused before a byte is received, the group closed,
        # the pause that start took lifted, and the adapter as it was.
        control = sender.clients[0].control
        control.start_weight_update()
        misnamed = {k.replace("q_proj", "rotary"): v for k, v in factors.items()}
        info = {
            "names": list(misnamed),
            "dtype_names": ["float32"] * len(misnamed),
            "shapes": [list(t.shape) for t in misnamed.values()],
            "lora_name": "mem",
        }
        with pytest.raises(Exception, match="not a linear of the model"):
            control.receive_weights(info)
        with lora_server.client() as client:
            assert client.get("/is_paused").json() == {"is_paused": False}
        _assert_serves(lora_server, "mem", reference, "mem-3")
    finally:
        sender.close()
    _unload(lora_server, "mem")


def test_adapter_factors_larger_than_announced(lora_server: Server) -> None:
    """A trainer that broadcasts a factor larger than the one it named (gloo aborts the
    receiving process): a 400, the server alive, and no adapter loaded."""
    if SESSION_ENGINE["kind"] == "vllm":
        pytest.skip("on vLLM: the abort path of test_weight_transfer's larger case (CI time)")
    from tokenwire.client import Client
    from tokenwire.client.weights import WeightSender
    from tokenwire.weight_transfer import broadcast, dtype_name

    trainer = _peft_adapter(12, ["q_proj", "v_proj"])
    factors = _factors(trainer)
    named = sorted(factors, key=lambda name: factors[name].numel())  # smallest first
    body = {
        "names": named,
        "dtypes": [dtype_name(factors[n].dtype) for n in named],
        "shapes": [list(factors[n].shape) for n in named],
        "lora_name": "wrong",
        "lora_config": json.loads(
            json.dumps(trainer.peft_config["default"].to_dict(), default=sorted)
        ),
    }
    sender = WeightSender([Client(lora_server.url, api_key=API_KEY)], timeout_s=30)
    sender.connect()
    try:
        with ThreadPoolExecutor(1) as pool, lora_server.client() as client:
            answer = pool.submit(client.post, "/update_weights_from_distributed", json=body)
            with contextlib.suppress(RuntimeError):  # the server closed the group
                for name in reversed(named):  # the largest first
                    broadcast(factors[name], sender._group)
            response = answer.result()
            assert_error(response, 400, "more bytes than announced")
            assert client.get("/health").status_code == 200
            models = [m["id"] for m in client.get("/v1/models").json()["data"]]
            assert "wrong" not in models
    finally:
        sender.close()


def test_sglang_adapter_from_tensors(lora_server: Server, lora_adapters: list[Path]) -> None:
    """SGLang's ``/load_lora_adapter_from_tensors`` (both entry fields) and
    ``/update_weights_from_tensor {lora_name}``: safetensors bytes in, PEFT's logprobs out."""
    from safetensors.torch import load_file

    config = adapter_files.read_config(lora_adapters[1])
    tensors = load_file(lora_adapters[1] / adapter_files.WEIGHTS_FILE)
    with lora_server.client() as client:
        body = {
            "lora_name": "sg",
            "config_dict": config,
            "serialized_tensors": _b64_safetensors(tensors),
            "load_format": "safetensors",
            "weight_version": "sg-1",
        }
        response = client.post("/load_lora_adapter_from_tensors", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["success"] is True
        assert response.json()["loaded_adapters"]["sg"] == "__tensor__"
        _assert_serves(lora_server, "sg", lora_adapters[1], "sg-1")

        # The same adapter's name with adapter 2's factors and config: replaced in place.
        config2 = adapter_files.read_config(lora_adapters[2])
        tensors2 = load_file(lora_adapters[2] / adapter_files.WEIGHTS_FILE)
        body = {
            "serialized_named_tensors": [_b64_safetensors(tensors2)],
            "load_format": "safetensors",
            "lora_name": "sg",
            "lora_config": config2,
            "weight_version": "sg-2",
        }
        response = client.post("/update_weights_from_tensor", json=body)
        assert response.status_code == 200, response.text
        _assert_serves(lora_server, "sg", lora_adapters[2], "sg-2")
        cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
        assert cards["sg"]["root"] == "__tensor__"
    _unload(lora_server, "sg")


def test_bad_adapters_from_memory_are_refused(
    lora_server: Server, lora_adapters: list[Path]
) -> None:
    """Each misfit is a 400 naming it; nothing loads, the server is not left paused, and
    generation (base and a0) goes on."""
    from safetensors.torch import load_file

    config = adapter_files.read_config(lora_adapters[0])
    tensors = load_file(lora_adapters[0] / adapter_files.WEIGHTS_FILE)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    misnamed = {k.replace("q_proj", "rotary"): v for k, v in tensors.items()}

    def from_tensors(**change: Any) -> dict:
        body = {
            "lora_name": "bad",
            "config_dict": config,
            "serialized_tensors": _b64_safetensors(tensors),
            "load_format": "safetensors",
            **change,
        }
        return body

    # The engine checks an adapter's factors (the hf engine with its own messages; vLLM's
    # workers with theirs); the pipeline checks the rest, the same on both.
    hf = SESSION_ENGINE["kind"] == "hf"
    half = {f"{q}.lora_A.weight": tensors[f"{q}.lora_A.weight"]}
    cases = [
        (from_tensors(load_format=None), "pickles"),
        (from_tensors(added_tokens_config={"<x>": 50000}), "added_tokens_config"),
        (from_tensors(serialized_tensors="not base64!"), "base64"),
        (from_tensors(lora_name="smollm2-135m-instruct"), "base model"),
        (from_tensors(serialized_tensors=_b64_safetensors(misnamed)), "not a linear" * hf),
        (from_tensors(config_dict={**config, "r": 32}), "above --max-lora-rank 16" * hf),
        (from_tensors(serialized_tensors=_b64_safetensors(half)), "needs both lora_A" * hf),
    ]
    with lora_server.client() as client:
        for body, message in cases:
            response = client.post("/load_lora_adapter_from_tensors", json=body)
            assert response.status_code == 400, response.text
            assert message in response.text, response.text
        # Factors alone for an adapter never loaded: its config is unknown.
        response = client.post(
            "/update_weights_from_tensor",
            json={
                "serialized_named_tensors": [_b64_safetensors(tensors)],
                "load_format": "safetensors",
                "lora_name": "never-loaded",
            },
        )
        assert response.status_code == 400, response.text
        assert "lora_config" in response.text
        # An adapter update inside vLLM's phases that names a module the model lacks: refused
        # before a byte is received, the group closed and the pause lifted.
        info = {
            "names": list(misnamed),
            "dtype_names": ["float32"] * len(misnamed),
            "shapes": [list(t.shape) for t in misnamed.values()],
            "lora_name": "a0",
        }
        response = client.post("/update_weights", json={"update_info": info})
        assert response.status_code == 400, response.text  # no group: init first
        assert client.get("/is_paused").json() == {"is_paused": False}
        listed = {card["id"] for card in client.get("/v1/models").json()["data"]}
    assert "bad" not in listed and "never-loaded" not in listed
    assert _generate(lora_server, "a0", PROMPT)["choices"][0]["token_ids"]
    assert _generate(lora_server, None, PROMPT)["choices"][0]["token_ids"]
