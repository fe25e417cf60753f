"""The hf engine's prefix cache over HTTP on SmolLM2: cached tokens in usage, trainer parity with
a cached prefix, one prefill for the n choices of a request, metrics, and the flag's checks.
(Reset and weight reloads: test_rl_control.py; an image change: test_multimodal.py.)"""

from __future__ import annotations

import random
import re
import subprocess
import sys

import httpx
import pytest
import torch

from tests.test_generate import generate, smollm2_model  # noqa: F401 - a fixture

pytestmark = pytest.mark.hf_only  # vLLM's cache has its own block size and counters


def ids_of(seed: int, length: int) -> list[int]:
    """A prompt no other test sends: seeded ids from the middle of the vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(length)]


def cached(usage: dict) -> int:
    return usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)


def metric(client: httpx.Client, name: str) -> float:
    text = client.get("/metrics").text
    match = re.search(rf"^tokenwire_engine_prefix_cache_{name} (\S+)$", text, re.M)
    assert match, f"no prefix cache metric {name}"
    return float(match.group(1))


def test_a_repeated_512_token_prompt_reports_cached_tokens(smollm2: httpx.Client) -> None:
    prompt = ids_of(512, 512)
    first = generate(smollm2, prompt, temperature=0, max_tokens=2)
    assert "prompt_tokens_details" not in first["usage"]
    second = generate(smollm2, prompt, temperature=0, max_tokens=2)
    assert 480 <= cached(second["usage"]) < 512
    assert second["usage"]["prompt_tokens"] == 512
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def test_logprobs_with_a_cached_prefix_match_a_full_forward(
    smollm2: httpx.Client,
    smollm2_model,  # noqa: F811 - the fixture imported above
) -> None:
    """Turn 2 of a rollout reuses turn 1's prompt and output blocks; its logprobs still equal
    log_softmax of one forward over the full ids."""
    prompt = ids_of(2, 300)
    turn1 = generate(smollm2, prompt, temperature=0, max_tokens=8)["choices"][0]["token_ids"]
    turn2_prompt = [*prompt, *turn1, *ids_of(3, 40)]
    for sampling in (
        {"temperature": 0, "max_tokens": 8, "logprobs": 5},
        {"temperature": 1.0, "max_tokens": 8, "logprobs": 0},
        {"temperature": 1.0, "seed": 5, "max_tokens": 8, "logprobs": 0},
    ):
        response = generate(smollm2, turn2_prompt, **sampling)
        if "seed" in sampling:  # a seed promises the same ids whatever ran before: no reuse
            assert cached(response["usage"]) == 0
        else:  # prompt + 7 fed outputs, in full 16-token blocks
            assert cached(response["usage"]) >= 304
        choice = response["choices"][0]
        ids = torch.tensor([turn2_prompt + choice["token_ids"]])
        with torch.no_grad():
            logits = smollm2_model(input_ids=ids).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1)[len(turn2_prompt) - 1 : -1]
        for position, entry in enumerate(choice["logprobs"]["content"]):
            expected = reference[position, choice["token_ids"][position]].item()
            assert abs(entry["logprob"] - expected) < 1e-4


def test_the_n_choices_of_a_request_share_one_prefill(smollm2: httpx.Client) -> None:
    """Choice 0 prefills the prompt, choices 1..3 take it from the cache."""
    prompt = ids_of(4, 256)
    hits, misses = metric(smollm2, "hits"), metric(smollm2, "misses")
    hit_tokens = metric(smollm2, "hit_tokens")
    together = generate(smollm2, prompt, n=4, temperature=1.0, max_tokens=6)
    assert metric(smollm2, "misses") == misses + 1
    assert metric(smollm2, "hits") == hits + 3
    assert metric(smollm2, "hit_tokens") == hit_tokens + 3 * 240
    assert metric(smollm2, "bytes") > 0
    assert len(together["choices"]) == 4


def test_seeded_choices_do_not_read_the_cache(smollm2: httpx.Client) -> None:
    """Each seeded choice computes the prompt itself and samples what a request with its own
    seed samples alone, whatever the cache holds."""
    prompt = ids_of(5, 256)
    hits = metric(smollm2, "hits")
    sampling = {"temperature": 1.0, "seed": 11, "max_tokens": 6}
    together = generate(smollm2, prompt, n=4, **sampling)
    assert metric(smollm2, "hits") == hits
    for index, choice in enumerate(together["choices"]):
        alone = generate(smollm2, prompt, **{**sampling, "seed": 11 + index})
        assert alone["choices"][0]["token_ids"] == choice["token_ids"]
        assert cached(alone["usage"]) == 0
    assert metric(smollm2, "hits") == hits


def test_openai_routes_report_cached_tokens(smollm2: httpx.Client) -> None:
    prompt = ids_of(6, 200)
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = smollm2.post("/v1/completions", json=body).json()
    assert "prompt_tokens_details" not in first["usage"]
    second = smollm2.post("/v1/completions", json=body).json()
    assert cached(second["usage"]) == 192
    streamed = smollm2.post(
        "/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ).text
    assert '"prompt_tokens_details":{"cached_tokens":192}' in streamed.replace(" ", "")


def test_cache_salt_partitions_the_cache(smollm2: httpx.Client) -> None:
    """vLLM's semantics: blocks are shared only by requests with the same salt, so one client
    cannot learn from cached_tokens that another (salted or not) sent a prefix."""

    def salted(prompt: list[int], salt: str | None) -> dict:
        body: dict = {"token_ids": prompt, "sampling_params": {"max_tokens": 2, "temperature": 0}}
        if salt is not None:
            body["cache_salt"] = salt
        response = smollm2.post("/inference/v1/generate", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    prompt = ids_of(7, 160)
    first = salted(prompt, "tenant-a")
    for other in ("tenant-b", None):  # another salt, and none
        answer = salted(prompt, other)
        assert cached(answer["usage"]) == 0, other
        assert answer["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert cached(salted(prompt, "tenant-a")["usage"]) == 144  # same salt: a hit
    # ... and a prefix one tenant stored (with its output) is not another's either.
    longer = [*prompt, *first["choices"][0]["token_ids"], *ids_of(8, 40)]
    assert cached(salted(longer, "tenant-b")["usage"]) == 160  # tenant-b's own, output too
    assert cached(salted(longer, "tenant-c")["usage"]) == 0
    assert cached(salted(prompt, None)["usage"]) == 144  # the unsalted entry from above


@pytest.mark.parametrize(("value", "message"), [("-1", ">= 0"), ("1GiB", "invalid int")])
def test_bad_prefix_cache_bytes_are_refused(value: str, message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tokenwire.cli", "serve", "--prefix-cache-bytes", value],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "--prefix-cache-bytes" in result.stderr and message in result.stderr
