"""A mixture-of-experts model served with routed-experts capture (R3), checked as a trainer
would use it: the routing a request returns is what one transformers forward of the whole
sequence routes, and a forward forced to that routing gives the server's logprobs.

One server (``moe_server``: qwen3-moe-tiny, 2 sparse layers, 8 experts, top 2, a 48-token
prefill budget); requests run batched (concurrently, one with n = 2, two prefilled together,
one in chunks, decodes joined mid-way), one extends a finished request's prompt and output and
hits the prefix cache, one asks from ``routed_experts_prompt_start``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import Server, assert_error
from tokenwire.client import decode_routed_experts, decode_sglang_routed_experts

LAYERS, TOP_K = 2, 2
PARITY = 1e-4


@pytest.fixture(scope="module")
def moe(moe_server: Server) -> Iterator[httpx.Client]:
    with moe_server.client() as client:
        yield client


@pytest.fixture(scope="module")
def moe_dir() -> Path:
    from tokenwire.assets import prepare

    return prepare("qwen3-moe-tiny")


@pytest.fixture(scope="module")
def moe_model(moe_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def _generate(client: httpx.Client, prompt: list[int], **sampling: Any) -> dict[str, Any]:
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 12, "logprobs": 0, **sampling}}
    response = client.post("/inference/v1/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _router_top_k(model: Any, seq: list[int]) -> np.ndarray:
    """The routing of a plain forward of ``seq``: [tokens, layers, top_k], ranked."""
    with torch.inference_mode():
        out = model(torch.tensor([seq]), output_router_logits=True)
    return np.stack([r.topk(TOP_K, dim=-1).indices.numpy() for r in out.router_logits], axis=1)


def _replayed_logprobs(model: Any, seq: list[int], routes: np.ndarray) -> torch.Tensor:
    """log_softmax of a forward of ``seq`` whose every router is forced to ``routes``: each
    layer's gate weights the given experts by its own probabilities (normalised over them, as
    Qwen3-MoE's ``norm_topk_prob``), as a trainer replaying R3 does."""
    routers = [layer.mlp.gate for layer in model.model.layers]
    forced = torch.from_numpy(routes.astype(np.int64))
    originals = [router.forward for router in routers]

    def force(router: Any, layer: int) -> Any:
        def forward(hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
            logits = F.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
            picked = forced[:, layer]
            weights = logits.float().softmax(-1).gather(1, picked)
            if router.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), picked

        return forward

    try:
        for layer, router in enumerate(routers):
            router.forward = force(router, layer)
        with torch.inference_mode():
            logits = model(torch.tensor([seq])).logits[0]
    finally:
        for router, original in zip(routers, originals, strict=True):
            router.forward = original
    return torch.log_softmax(logits.float(), dim=-1)


def _check_choice(model: Any, prompt: list[int], choice: dict[str, Any], start: int = 0) -> None:
    """The choice's routing has vLLM's shape and dtype, equals a plain forward's router top-k,
    and replays to the server's logprobs."""
    routes = decode_routed_experts(choice["routed_experts"])
    output = choice["token_ids"]
    seq = [*prompt, *output]
    assert routes.shape == (len(seq) - 1 - start, LAYERS, TOP_K)
    assert routes.dtype == np.uint8
    fed = seq[:-1]  # the last sampled token was never fed: it has no routing
    np.testing.assert_array_equal(routes, _router_top_k(model, fed)[start:])
    if start:
        return
    logprobs = _replayed_logprobs(model, fed, routes)
    served = torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]])
    replayed = logprobs[len(prompt) - 1 :].gather(1, torch.tensor(output).unsqueeze(1))[:, 0]
    assert torch.allclose(replayed, served, atol=PARITY), (replayed - served).abs().max()


def test_routing_replays_across_batches_and_prefix_cache_hits(
    moe: httpx.Client, moe_model: Any
) -> None:
    """Batched requests (one with n = 2, sampled) and, once the first has finished, a request
    extending its prompt and output: it hits the prefix cache, and the cached positions'
    routing comes back from it equal to a fresh forward's."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(100, 150_000, size=size).tolist() for size in (37, 21, 50, 9)]
    samplings = [{"temperature": 0}, {"temperature": 1.0, "n": 2}, {"temperature": 0.7}, {}]
    with ThreadPoolExecutor(len(prompts)) as pool:
        pairs = zip(prompts, samplings, strict=True)
        jobs = [pool.submit(_generate, moe, prompt, **sampling) for prompt, sampling in pairs]
        results = [job.result() for job in jobs]
    for prompt, result in zip(prompts, results, strict=True):
        for choice in result["choices"]:
            _check_choice(moe_model, prompt, choice)
    first = results[0]["choices"][0]
    extended = [*prompts[0], *first["token_ids"], 11, 12, 13]
    hit = _generate(moe, extended, temperature=0)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    _check_choice(moe_model, extended, hit["choices"][0])
    # A later turn asks only for what it has not seen (verifiers' bridged turns).
    tail = _generate(moe, extended, temperature=0, routed_experts_prompt_start=40)
    _check_choice(moe_model, extended, tail["choices"][0], start=40)


def test_sglang_generate_returns_int32_routing_from_its_start(
    moe: httpx.Client, moe_model: Any
) -> None:
    prompt = list(range(1000, 1030))
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        "return_routed_experts": True,
        "routed_experts_start_len": 5,
    }
    response = moe.post("/generate", json=body)
    assert response.status_code == 200, response.text
    meta = response.json()["meta_info"]
    routes = decode_sglang_routed_experts(meta["routed_experts"], LAYERS, TOP_K)
    seq = [*prompt, *response.json()["output_ids"]]
    assert meta["routed_experts_start_len"] == 5 and routes.dtype == np.int32
    np.testing.assert_array_equal(routes, _router_top_k(moe_model, seq[:-1])[5:])
    bad = moe.post("/generate", json={**body, "routed_experts_start_len": 31})
    assert_error(bad, 400, "routed_experts_start_len")


def test_routing_asked_of_a_server_that_does_not_capture_is_a_400(qwen3: httpx.Client) -> None:
    body = {"token_ids": [1, 2, 3], "sampling_params": {"return_routed_experts": True}}
    refused = qwen3.post("/inference/v1/generate", json=body)
    error = assert_error(refused, 400, "--enable-return-routed-experts")
    assert error["param"] == "sampling_params.return_routed_experts"
    # verifiers sends the start on every bridged turn: ignored without capture, as vLLM does.
    quiet = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1}}
    quiet["sampling_params"]["routed_experts_prompt_start"] = 2  # type: ignore[index]
    answer = qwen3.post("/inference/v1/generate", json=quiet)
    assert answer.status_code == 200 and "routed_experts" not in answer.json()["choices"][0]


def test_checkpoint_reload_by_per_expert_names(
    moe: httpx.Client, moe_dir: Path, tmp_path: Path
) -> None:
    """A checkpoint names experts one by one (``experts.3.down_proj.weight``), as trainers and
    vLLM do; they land in transformers' fused expert tensors: the server then answers as the
    changed checkpoint loaded by transformers does."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    tensors = load_file(str(moe_dir / "model.safetensors"))
    for name in [n for n in tensors if ".experts.3." in n or ".experts.5.up_proj" in n]:
        tensors[name] = tensors[name] * 3.0
    changed = tmp_path / "changed"
    changed.mkdir()
    save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(moe_dir / "config.json", changed / "config.json")
    prompt = list(range(2000, 2040))
    try:
        reload = moe.post("/update_weights", json={"weight_dir": str(changed)})
        assert reload.status_code == 200, reload.text
        choice = _generate(moe, prompt, temperature=0)["choices"][0]
        model = AutoModelForCausalLM.from_pretrained(changed, dtype=torch.float32).eval()
        _check_choice(model, prompt, choice)
    finally:
        restore = moe.post("/update_weights", json={"weight_dir": str(moe_dir)})
        assert restore.status_code == 200, restore.text
