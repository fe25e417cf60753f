"""A mixture-of-experts model served with routed-experts capture (R3), checked as a trainer
would use it: the routing a request returns is what one transformers forward of the whole
sequence routes, and a forward forced to that routing gives the server's logprobs.

One server (``moe_server``: qwen3-moe-tiny, 2 sparse layers, 8 experts, top 2, a 48-token
prefill budget); requests run batched (concurrently, one with n = 2, two prefilled together,
one in chunks, decodes joined mid-way), one extends a finished request's prompt and output and
hits the prefix cache, one asks from ``routed_experts_prompt_start``.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import Server, assert_error
from tokenwire.client import (
    AsyncClient,
    Rollout,
    RolloutResult,
    decode_routed_experts,
    decode_sglang_routed_experts,
)

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
def moe_model(moe_dir: Path) -> Iterator[Any]:
    """The model in transformers, run on one thread while this module's tests use it: its ops
    are tiny, and two OpenMP threads on a busy two-core machine made each forward ~50x slower
    (spinning threads waiting on each other)."""
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    finally:
        torch.set_num_threads(threads)


def _generate(
    client: httpx.Client, prompt: list[int], model: str | None = None, **sampling: Any
) -> dict[str, Any]:
    """``model``: a loaded adapter's name (None: the base)."""
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 12, "logprobs": 0, **sampling}}
    if model is not None:
        body["model"] = model
    response = client.post("/inference/v1/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _router_top_k(model: Any, seq: list[int]) -> np.ndarray:
    """The routing of a plain forward of ``seq``: [tokens, layers, top_k], ranked (one
    position's logits: the lm_head over the whole vocabulary is most of a forward's time)."""
    with torch.inference_mode():
        out = model(torch.tensor([seq]), output_router_logits=True, logits_to_keep=1)
    return np.stack([r.topk(TOP_K, dim=-1).indices.numpy() for r in out.router_logits], axis=1)


def _replayed_logprobs(model: Any, seq: list[int], routes: np.ndarray, keep: int) -> torch.Tensor:
    """log_softmax of the last ``keep`` positions of a forward of ``seq`` whose every router is
    forced to ``routes``: each
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
            logits = model(torch.tensor([seq]), logits_to_keep=keep).logits[0]
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
    logprobs = _replayed_logprobs(model, fed, routes, keep=len(output))
    served = torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]])
    replayed = logprobs.gather(1, torch.tensor(output).unsqueeze(1))[:, 0]
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


def _chat(
    client: httpx.Client, messages: list[dict[str, Any]], session: str | None = None
) -> dict[str, Any]:
    body = {
        "messages": messages,
        "max_tokens": 8,
        "temperature": 1.0,
        "logprobs": True,
        "return_token_ids": True,
    }
    headers = {"X-Session-ID": session} if session else {}
    response = client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def _streamed(client: httpx.Client, body: dict[str, Any], started: Any) -> dict[str, Any]:
    """A streamed generate's one choice, put back together; ``started()`` runs once its second
    chunk came (the request is decoding)."""
    choice: dict[str, Any] = {"token_ids": [], "logprobs": {"content": []}}
    with client.stream("POST", "/inference/v1/generate", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        for count, line in enumerate(line for line in resp.iter_lines() if line):
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            if count == 1:
                started()
            for part in orjson.loads(data)["choices"]:
                choice["token_ids"] += part["token_ids"]
                choice["logprobs"]["content"] += part["logprobs"]["content"]
                if "routed_experts" in part:
                    choice["routed_experts"] = part["routed_experts"]
    return choice


def test_acceptance_32_seeded_requests_replay_token_by_token(
    moe: httpx.Client, moe_model: Any
) -> None:
    """Issue 32's acceptance run: 32 requests of a seeded run, batched, some joining a decode
    under way, some hitting the prefix cache, some extended multi-turn (extend, then generate;
    and sessions over chat): every token's returned experts are a plain forward's router top-k,
    and a forward forced to them gives the server's logprobs within 1e-4. The first 16 sample
    with a seed; the rest sample without one, as a seeded request never reads the prefix cache
    (its logits must not depend on what ran before) and these are to hit it."""
    rng = np.random.default_rng(32)
    checks: list[tuple[list[int], dict[str, Any]]] = []  # (prompt, choice) of every request

    def seeded(prompt: list[int], seed: int | None, **extra: Any) -> dict[str, Any]:
        params = {"max_tokens": 10, "logprobs": 0, "temperature": 1.0, "seed": seed, **extra}
        return {"token_ids": prompt, "sampling_params": params}

    def post(body: dict[str, Any]) -> dict[str, Any]:
        response = moe.post("/inference/v1/generate", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    prompts = [rng.integers(100, 150_000, size=int(n)).tolist() for n in rng.integers(5, 70, 15)]
    long_prompt = rng.integers(100, 150_000, size=20).tolist()
    with ThreadPoolExecutor(8) as pool:
        # 9 at once (prefilled together and in chunks), then a long one streamed; 6 more join
        # once it decodes.
        first = [pool.submit(post, seeded(p, i)) for i, p in enumerate(prompts[:9])]
        joining: list[Any] = []

        def join() -> None:
            joining.extend(pool.submit(post, seeded(p, 9 + i)) for i, p in enumerate(prompts[9:]))

        long_body = seeded(long_prompt, 99, max_tokens=40, ignore_eos=True)
        long_choice = _streamed(moe, long_body, join)
        batched = [job.result() for job in [*first, *joining]]
    assert len(joining) == 6 and len(long_choice["token_ids"]) == 40
    checks.append((long_prompt, long_choice))
    checks += [(p, r["choices"][0]) for p, r in zip(prompts, batched, strict=True)]
    # 6 prefix-cache hits, at once: a longer earlier request's prompt and output, then a few
    # more tokens (the cache keeps whole blocks).
    hits = []
    for index in sorted(range(15), key=lambda i: -len(prompts[i]))[:6]:
        choice = batched[index]["choices"][0]
        hits.append([*prompts[index], *choice["token_ids"], *rng.integers(100, 9000, 3).tolist()])
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda prompt: post(seeded(prompt, None)), hits))
    for prompt, hit in zip(hits, answers, strict=True):
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        checks.append((prompt, hit["choices"][0]))
    # 2 conversations, each a chat turn and one extended by /v1/chat/completions/extend.
    for seed in range(2):
        messages = [{"role": "user", "content": f"Tell me about the number {seed}."}]
        answer = _chat(moe, messages)
        checks.append((answer["prompt_token_ids"], answer["choices"][0]))
        reply = {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
        body = {
            "previous_messages": [*messages, reply],
            "previous_token_ids": [*answer["prompt_token_ids"], *answer["choices"][0]["token_ids"]],
            "messages": [{"role": "user", "content": "And then?"}],
            "keep_history": True,
        }
        extend = moe.post("/v1/chat/completions/extend", json=body)
        assert extend.status_code == 200, extend.text
        assert extend.json()["extended"]
        turn = extend.json()["token_ids"]
        second = post(seeded(turn, None))
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        checks.append((turn, second["choices"][0]))
    # 2 sessions of 3 chat turns: each turn's recorded routing is its answer's, and each
    # segment's joined routing replays over the segment's ids.
    for session in ("r3-a", "r3-b"):
        messages: list[dict[str, Any]] = []
        answered = []
        for turn_index in range(3):
            messages.append({"role": "user", "content": f"Turn {turn_index} of {session}."})
            answer = _chat(moe, messages, session=session)
            choice = answer["choices"][0]
            checks.append((answer["prompt_token_ids"], choice))
            answered.append(decode_routed_experts(choice["routed_experts"]))
            messages.append({"role": "assistant", "content": choice["message"]["content"]})
        stored = moe.get(f"/v1/sessions/{session}").json()
        (segment,) = stored["segments"]
        turns = stored["turns"]
        # Each turn keeps the rows the previous one has none of: from its last sampled id on.
        starts = [0, *(len(t["prompt_ids"]) + len(t["sampled_ids"]) - 1 for t in turns[:-1])]
        for turn, rows, start in zip(turns, answered, starts, strict=True):
            assert turn["routed_experts_start"] == start
            recorded = decode_routed_experts(turn["routed_experts"])
            np.testing.assert_array_equal(recorded, rows[start:])
        np.testing.assert_array_equal(
            decode_routed_experts(segment["routed_experts"]),
            _router_top_k(moe_model, segment["token_ids"][:-1]),
        )
    assert len(checks) == 32
    for prompt, choice in checks:
        _check_choice(moe_model, prompt, choice)


def test_completions_return_routing_from_its_start_whole_and_streamed(
    moe: httpx.Client, moe_model: Any
) -> None:
    """vLLM 0.33's ``routed_experts_prompt_start`` and ``routed_experts`` on /v1/completions;
    streamed, the routing comes with the choice's last chunk."""
    prompt = list(range(3000, 3030))
    body = {
        "prompt": prompt,
        "max_tokens": 5,
        "temperature": 0,
        "return_token_ids": True,
        "routed_experts_prompt_start": 7,
    }
    whole = moe.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    _check_choice(moe_model, prompt, whole.json()["choices"][0], start=7)
    streamed: dict[str, Any] = {"token_ids": []}
    with moe.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                (part,) = orjson.loads(line.removeprefix("data: "))["choices"]
                streamed["token_ids"] += part["token_ids"]
                assert ("routed_experts" in part) == (part["finish_reason"] is not None)
                streamed.update({k: v for k, v in part.items() if k == "routed_experts"})
    _check_choice(moe_model, prompt, streamed, start=7)
    bad = moe.post("/v1/completions", json={**body, "routed_experts_prompt_start": 31})
    assert_error(bad, 400, "routed_experts_prompt_start")


def test_rollout_gives_the_episode_routing_a_trainer_replays(
    moe_server: Server, moe_model: Any
) -> None:
    """tokenwire.client's Rollout (render, generate, derender, extend): the episode's ids,
    loss mask, logprobs and routing replay in one forward, as a trainer uses them."""

    async def run() -> RolloutResult:
        async with AsyncClient(moe_server.url) as client:
            rollout = Rollout(client, max_turns=2, max_tokens=6, temperature=1.0)
            asked = [{"role": "user", "content": "Count with me."}]
            return await rollout.run(asked, lambda turn: [{"role": "user", "content": "More."}])

    result = asyncio.run(run())
    ids, routing = result.token_ids, result.routing
    assert len(result.turns) == 2 and result.prefix_breaks == 0 and routing is not None
    np.testing.assert_array_equal(routing, _router_top_k(moe_model, ids[:-1]))
    replayed = _replayed_logprobs(moe_model, ids[:-1], routing, keep=len(ids) - 1)
    sampled = [j for j, bit in enumerate(result.loss_mask) if bit]
    expected = replayed[[j - 1 for j in sampled], [ids[j] for j in sampled]]
    served = torch.tensor([result.logprobs[j] for j in sampled])
    assert torch.allclose(expected, served, atol=PARITY), (expected - served).abs().max()


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
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    answer = qwen3.post("/v1/chat/completions", json={**chat, "routed_experts_prompt_start": 99})
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


def _check_greedy(model: Any, prompt: list[int], choice: dict[str, Any]) -> None:
    """A greedy choice is ``model``'s: each output id its forward's argmax, and (``_check_choice``)
    its routing and logprobs within 1e-4."""
    seq = [*prompt, *choice["token_ids"]]
    with torch.inference_mode():
        logits = model(torch.tensor([seq[:-1]]), logits_to_keep=len(choice["token_ids"])).logits
    assert logits[0].argmax(-1).tolist() == choice["token_ids"]
    _check_choice(model, prompt, choice)


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _fresh(moe_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def test_lora_on_attention_matches_peft_beside_the_base(
    moe: httpx.Client, moe_dir: Path, moe_model: Any, tmp_path: Path
) -> None:
    """A PEFT adapter of the attention projections (the MoE model's linear layers) served
    beside the base in one batch: its greedy ids, logprobs and routing are PEFT's forward's,
    the base's the base model's. An adapter of the fused experts is a 400 naming them, in
    PEFT's own form (``target_parameters``) and per expert (transformers 4's and vLLM's)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import save_file

    torch.manual_seed(11)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=ATTENTION, init_lora_weights=False)
    get_peft_model(_fresh(moe_dir), config).save_pretrained(tmp_path / "attention")
    loaded = moe.post(
        "/v1/load_lora_adapter",
        json={"lora_name": "moe-attn", "lora_path": str(tmp_path / "attention")},
    )
    assert loaded.status_code == 200, loaded.text
    prompt = list(range(4000, 4030))
    try:
        with ThreadPoolExecutor(2) as pool:
            jobs = [
                pool.submit(_generate, moe, prompt, temperature=0, **extra)
                for extra in ({}, {"model": "moe-attn"})
            ]
            base, adapted = (job.result()["choices"][0] for job in jobs)
    finally:
        unload = moe.post("/v1/unload_lora_adapter", json={"lora_name": "moe-attn"})
        assert unload.status_code == 200, unload.text
    _check_greedy(moe_model, prompt, base)
    # PEFT injects the adapter into the model it wraps: that model's forward is PEFT's.
    peft = PeftModel.from_pretrained(_fresh(moe_dir), tmp_path / "attention").get_base_model()
    _check_greedy(peft, prompt, adapted)
    served = [[e["logprob"] for e in c["logprobs"]["content"]] for c in (base, adapted)]
    assert base["token_ids"] != adapted["token_ids"] or served[0] != served[1]
    assert adapted["weight_versions"][0]["version"].startswith("moe-attn@")

    experts = LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)
    experts.target_parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    get_peft_model(_fresh(moe_dir), experts).save_pretrained(tmp_path / "experts")
    per_expert = tmp_path / "per-expert"
    per_expert.mkdir()
    config_json = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["gate_proj"]}
    (per_expert / "adapter_config.json").write_text(orjson.dumps(config_json).decode())
    key = "base_model.model.model.layers.1.mlp.experts.3.gate_proj"
    factors = {
        f"{key}.lora_A.weight": torch.zeros(4, 64),
        f"{key}.lora_B.weight": torch.zeros(32, 4),
    }
    save_file(factors, str(per_expert / "adapter_model.safetensors"))
    for name, layer in (("experts", 0), ("per-expert", 1)):
        body = {"lora_name": name, "lora_path": str(tmp_path / name)}
        refused = moe.post("/v1/load_lora_adapter", json=body)
        assert refused.status_code == 400, refused.text
        assert f"targets model.layers.{layer}.mlp.experts (" in refused.text
        assert "fused experts of a mixture-of-experts layer" in refused.text
    assert _generate(moe, prompt, temperature=0)["choices"][0]["token_ids"] == base["token_ids"]


def _per_expert(model: Any) -> list[tuple[str, torch.Tensor]]:
    """``model``'s weights as a checkpoint names them: the fused expert parameters one expert and
    projection at a time (``mlp.experts.3.gate_proj.weight`` [I, H], ``up_proj``, ``down_proj``
    [H, I]), as trainers send them and vLLM loads them."""
    named: list[tuple[str, torch.Tensor]] = []
    for name, param in model.named_parameters():
        prefix, _, kind = name.rpartition(".")
        if kind == "gate_up_proj":
            inter = param.shape[1] // 2
            for e, fused in enumerate(param.detach()):
                named.append((f"{prefix}.{e}.gate_proj.weight", fused[:inter]))
                named.append((f"{prefix}.{e}.up_proj.weight", fused[inter:]))
        elif kind == "down_proj" and param.dim() == 3:
            named += [(f"{prefix}.{e}.down_proj.weight", w) for e, w in enumerate(param.detach())]
        else:
            named.append((name, param.detach()))
    return named


def test_weights_from_a_trainer_by_per_expert_names(
    moe_server: Server, moe: httpx.Client, moe_dir: Path, moe_model: Any
) -> None:
    """A trainer's ``WeightSender`` over a gloo group, its experts named one at a time: the
    server then answers as a transformers forward of the sent weights (greedy ids, logprobs,
    routing). Before it, a missent expert tensor (another shape) and expert LoRA factors are
    400s naming them, and the server keeps its weights."""
    from tokenwire.client import Client
    from tokenwire.client.weights import WeightSender, WeightSenderError

    prompt = list(range(5000, 5030))
    base = _generate(moe, prompt, temperature=0)["choices"][0]
    _check_greedy(moe_model, prompt, base)
    trained = _fresh(moe_dir)
    torch.manual_seed(5)
    with torch.no_grad():
        for param in trained.parameters():
            param.add_(torch.randn_like(param) * param.std() * 0.3)
    named = _per_expert(trained)
    names = [name for name, _ in named]
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert not any(name.endswith(("gate_up_proj", "experts.down_proj")) for name in names)

    def send(weights: list[tuple[str, torch.Tensor]], **kwargs: Any) -> None:
        """One group per send: a refused update closes the server's end."""
        with WeightSender([Client(moe_server.url)], timeout_s=30) as sender:
            sender.send(weights, **kwargs)

    wrong = "model.layers.0.mlp.experts.3.gate_proj.weight"
    missent = [(n, torch.zeros(33, 64) if n == wrong else t) for n, t in named]
    with pytest.raises(WeightSenderError, match=rf"{re.escape(wrong)}.*\(32, 64\)"):
        send(missent, version="missent")
    info = moe.get("/weight_info").json()
    assert info["state"] == "whole" and info["weight_version"] != "missent"
    _check_greedy(moe_model, prompt, _generate(moe, prompt, temperature=0)["choices"][0])
    factors = [("base_model.model.model.layers.0.mlp.experts.lora_A.weight", torch.zeros(4, 64))]
    with pytest.raises(WeightSenderError, match=re.escape("targets model.layers.0.mlp.experts")):
        send(factors, lora_name="experts", lora_config={"r": 4, "lora_alpha": 8})
    try:
        send(named, version="per-expert-1")
        choice = _generate(moe, prompt, temperature=0)["choices"][0]
        assert choice["weight_versions"][0]["version"] == "per-expert-1"
        _check_greedy(trained, prompt, choice)
        logprobs = [[e["logprob"] for e in c["logprobs"]["content"]] for c in (base, choice)]
        assert max(abs(a - b) for a, b in zip(*logprobs, strict=True)) > 1e-2  # it changed
    finally:
        restore = moe.post("/update_weights", json={"weight_dir": str(moe_dir)})
        assert restore.status_code == 200, restore.text
    _check_greedy(moe_model, prompt, _generate(moe, prompt, temperature=0)["choices"][0])
