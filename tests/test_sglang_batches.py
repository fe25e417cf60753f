"""SGLang's /generate as RL frameworks send it: batches, n > 1, and prompt scoring, on SmolLM2.

skyrl-train sends ``input_ids: [[...]]`` (a batch, even of one), atroposlib ``n`` > 1 for its
groups, slime's on-policy distillation and AReaL's ``compute_logp`` score a sequence with
``max_new_tokens: 0`` and ``logprob_start_len: 0``.
"""

from __future__ import annotations

import json

import httpx
import pytest

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def prompt_ids(smollm2: httpx.Client) -> list[int]:
    return smollm2.post("/tokenize", json={"messages": PROMPT}).json()["tokens"]


def generate(client: httpx.Client, body: dict) -> dict | list:
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_batch_is_answered_in_order(smollm2: httpx.Client, prompt_ids: list[int]) -> None:
    other = prompt_ids[:-4]
    alone = [
        generate(smollm2, {"input_ids": ids, "sampling_params": GREEDY})
        for ids in (prompt_ids, other)
    ]
    # cache_salt (one per prompt, as SGLang takes it) is accepted.
    batch = generate(
        smollm2,
        {"input_ids": [prompt_ids, other], "sampling_params": GREEDY, "cache_salt": ["a", "b"]},
    )
    assert isinstance(batch, list) and len(batch) == 2
    assert [r["output_ids"] for r in batch] == [r["output_ids"] for r in alone]
    assert [r["meta_info"]["prompt_tokens"] for r in batch] == [len(prompt_ids), len(other)]
    # skyrl-train's shape: a batch of one is still a list.
    (one,) = generate(smollm2, {"input_ids": [prompt_ids], "sampling_params": GREEDY})
    assert one["output_ids"] == alone[0]["output_ids"]
    texts = generate(
        smollm2, {"text": ["The capital of France is", "2 + 2 ="], "sampling_params": GREEDY}
    )
    assert len(texts) == 2 and all(len(r["output_ids"]) == 6 for r in texts)


def test_n_choices_per_prompt_prompt_major(smollm2: httpx.Client, prompt_ids: list[int]) -> None:
    sampling = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "n": 3}
    results = generate(
        smollm2, {"input_ids": [prompt_ids, prompt_ids[:-4]], "sampling_params": sampling}
    )
    assert len(results) == 6
    prompt_tokens = [r["meta_info"]["prompt_tokens"] for r in results]
    assert prompt_tokens == [len(prompt_ids)] * 3 + [len(prompt_ids) - 4] * 3
    assert all(len(r["output_ids"]) == 8 for r in results)
    # atroposlib's group: one prompt, n > 1 -> a list of n.
    group = generate(smollm2, {"text": "Once upon a time", "sampling_params": {**sampling, "n": 2}})
    assert isinstance(group, list) and len(group) == 2
    # Streamed: each event is one choice's cumulative result, tagged with its index.
    body = {"input_ids": [prompt_ids, prompt_ids[:-4]], "sampling_params": GREEDY, "stream": True}
    with smollm2.stream("POST", "/generate", json=body) as response:
        events = [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")
        ]
    last = {event["index"]: event for event in events}
    assert sorted(last) == [0, 1] and all(len(e["output_ids"]) == 6 for e in last.values())


def test_scoring_a_sequence_gives_the_prompt_logprobs(
    smollm2: httpx.Client, prompt_ids: list[int]
) -> None:
    """``max_new_tokens: 0`` + ``logprob_start_len``: the logprob of every given id, no output;
    the same numbers as generate's ``prompt_logprobs`` (which equal a transformers forward)."""
    body = {
        "input_ids": prompt_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
    }
    scored = generate(smollm2, body)
    meta = scored["meta_info"]
    assert scored["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    rows = meta["input_token_logprobs"]
    assert [row[1] for row in rows] == prompt_ids and rows[0][0] is None
    reference = smollm2.post(
        "/inference/v1/generate",
        json={"token_ids": prompt_ids, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}},
    ).json()["prompt_logprobs"]
    for row, position, token_id in zip(rows[1:], reference[1:], prompt_ids[1:], strict=True):
        assert row[0] == pytest.approx(position[str(token_id)]["logprob"], abs=1e-5)
    # The top rows follow the one rule: the given token first, then the most likely other.
    tops = meta["input_top_logprobs"]
    assert tops[0] is None
    assert all(
        top[0][1] == row[1] and len(top) == 2 for top, row in zip(tops[1:], rows[1:], strict=True)
    )
    # From a later start: the tail only.
    tail = generate(smollm2, {**body, "logprob_start_len": 5})["meta_info"]["input_token_logprobs"]
    assert tail == rows[5:]
