"""Teacher scoring, ``logprob_token_ids`` and sampling masks on the real SmolLM2 server: the
values against a transformers forward; on the vllm engine, which serves only
``logprob_token_ids`` of them, the others are a 400 naming the field. Shapes and the other
refusals: ``test_fast_scoring``."""

from __future__ import annotations

import base64
import io
import json
import math
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.conftest import SESSION_ENGINE, assert_error

PARIS_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2_model():
    from transformers import AutoModelForCausalLM

    from tokenwire.assets import prepare

    return AutoModelForCausalLM.from_pretrained(str(prepare("smollm2-135m-instruct"))).eval()


@pytest.fixture(scope="module")
def paris_ids(smollm2: httpx.Client) -> list[int]:
    return smollm2.post("/tokenize", json={"messages": PARIS_MESSAGES}).json()["tokens"]


def forward_logprobs(model: Any, token_ids: list[int]) -> torch.Tensor:
    """[len, V]: row t is the log-distribution of token t + 1 (raw logits, as the engine's)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def refused_by_vllm(response: httpx.Response, param: str) -> bool:
    """On the vllm engine: check the 400 and say so (the test ends there)."""
    if SESSION_ENGINE["kind"] != "vllm":
        return False
    error = assert_error(response, 400, f"{param} is not supported by this server's engine")
    assert error["param"] == param
    return True


def test_prompt_token_id_logprobs_match_a_full_forward(
    smollm2: httpx.Client, smollm2_model: Any, paris_ids: list[int]
) -> None:
    """Rows of different widths (padded -1 -> -inf) from ``prompt_logprob_start`` on."""
    start = 3
    candidates = [28, 7, 2, 49151]
    rows = [[paris_ids[p + 1], *candidates[: p % 4]] for p in range(start, len(paris_ids) - 1)]
    sampling = {
        "temperature": 0,
        "max_tokens": 1,
        "prompt_logprob_token_ids": rows,
        "prompt_logprob_start": start,
    }
    response = smollm2.post(
        "/inference/v1/generate", json={"token_ids": paris_ids, "sampling_params": sampling}
    )
    if refused_by_vllm(response, "sampling_params.prompt_logprob_token_ids"):
        return
    assert response.status_code == 200, response.text
    encoded = response.json()["prompt_token_id_logprobs"]
    scores = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    width = max(map(len, rows))
    assert scores.dtype == np.float32 and scores.shape == (len(rows), width)
    reference = forward_logprobs(smollm2_model, paris_ids)
    for i, row in enumerate(rows):
        for j, token_id in enumerate(row):
            assert abs(scores[i, j] - reference[start + i, token_id].item()) < 1e-4, (i, j)
        assert np.all(np.isneginf(scores[i, len(row) :]))


def generate_events(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", "/inference/v1/generate", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        raw = resp.read().decode()
    frames = raw.split("\n\n")[:-2]  # the last two: "data: [DONE]" and the empty tail
    return [json.loads(frame.removeprefix("data: ")) for frame in frames]


@pytest.mark.parametrize("stream", [False, True])
def test_sampling_mask_at_top_k_5_is_each_steps_top_5(
    smollm2: httpx.Client, smollm2_model: Any, paris_ids: list[int], stream: bool
) -> None:
    """Five ids per step, the sampled one among them: the model's five most likely there."""
    sampling = {"temperature": 1.0, "top_k": 5, "max_tokens": 8, "seed": 11, "ignore_eos": True}
    body = {"token_ids": paris_ids, "sampling_params": sampling, "return_sampling_mask": True}
    if SESSION_ENGINE["kind"] == "vllm":
        response = smollm2.post("/inference/v1/generate", json=body)
        assert refused_by_vllm(response, "return_sampling_mask")
        return
    if stream:
        choices = [c for event in generate_events(smollm2, body) for c in event["choices"]]
        tokens = [t for c in choices for t in c["token_ids"]]
        masks = [m for c in choices for m in c["sampling_mask"]]
    else:
        response = smollm2.post("/inference/v1/generate", json=body)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        tokens, masks = choice["token_ids"], choice["sampling_mask"]
    assert len(tokens) == len(masks) == 8
    reference = forward_logprobs(smollm2_model, paris_ids + tokens)
    for step, (token, mask) in enumerate(zip(tokens, masks, strict=True)):
        assert len(mask) == 5 and token in mask and mask == sorted(mask)
        top5 = torch.topk(reference[len(paris_ids) - 1 + step], 5).indices.tolist()
        assert set(mask) == set(top5), step


def test_logprob_token_ids_match_a_full_forward(
    smollm2: httpx.Client, smollm2_model: Any, paris_ids: list[int]
) -> None:
    given = [28, 30, 2]
    sampling = {"temperature": 0, "max_tokens": 4, "logprob_token_ids": given}
    response = smollm2.post(
        "/inference/v1/generate", json={"token_ids": paris_ids, "sampling_params": sampling}
    )
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    reference = forward_logprobs(smollm2_model, paris_ids + choice["token_ids"])
    for step, entry in enumerate(choice["logprobs"]["content"]):
        row = reference[len(paris_ids) - 1 + step]
        listed = [(e["token_id"], e["logprob"]) for e in entry["top_logprobs"]]
        sampled = entry["token_id"]
        assert [i for i, _ in listed] == [sampled, *(i for i in given if i != sampled)]
        for token_id, logprob in listed:
            assert abs(logprob - row[token_id].item()) < 1e-4, (step, token_id)


def test_sglang_sampling_masks_and_their_logprobs(
    smollm2: httpx.Client, smollm2_model: Any, paris_ids: list[int]
) -> None:
    """SGLang's meta_info: each mask holds the sampled id; its logprob is the sampled token's
    probability renormalised over the mask."""
    body = {
        "input_ids": paris_ids,
        "sampling_params": {
            "temperature": 1.0,
            "top_k": 5,
            "max_new_tokens": 4,
            "sampling_seed": 5,
            "ignore_eos": True,
        },
        "return_sampling_mask": True,
    }
    response = smollm2.post("/generate", json=body)
    if refused_by_vllm(response, "return_sampling_mask"):
        return
    assert response.status_code == 200, response.text
    data = response.json()
    meta, tokens = data["meta_info"], data["output_ids"]
    masks, logprobs = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    assert meta["output_token_sampling_mask_length"] == len(masks) == len(tokens) == 4
    reference = forward_logprobs(smollm2_model, paris_ids + tokens)
    for step, (token, mask, logprob) in enumerate(zip(tokens, masks, logprobs, strict=True)):
        assert len(mask) == 5 and token in mask
        row = reference[len(paris_ids) - 1 + step]
        expected = row[token].item() - torch.logsumexp(row[mask], dim=0).item()
        assert math.isclose(logprob, expected, abs_tol=1e-4), step
