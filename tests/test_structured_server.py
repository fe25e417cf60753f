"""Structured outputs on the real server, whichever engine it runs (make test: hf; make
test-vllm: vLLM's, where tokenwire's grammar masks the logits inside vLLM's worker): sampled
outputs keep to a JSON schema, a regex and a choice list through the openai SDK and
/inference/v1/generate, and a constrained token's logprob is the model's own (raw mode), equal
to the same token's logprob when a request without the constraint is forced along the same
ids."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema_rs
import openai

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "fine": {"type": "boolean"},
    },
    "required": ["colour", "count", "fine"],
    "additionalProperties": False,
}
MESSAGES: list[Any] = [{"role": "user", "content": "Describe a thing as JSON."}]
N = 5


def test_json_schema_regex_and_choice(smollm2_openai: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    answer = smollm2_openai.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=MESSAGES,
        response_format=fmt,
        n=N,
        seed=5,
        temperature=1.0,
        max_tokens=96,
    )
    for choice in answer.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema_rs.validate(SCHEMA, json.loads(choice.message.content or ""))
    regex = smollm2_openai.completions.create(
        model="smollm2-135m-instruct",
        prompt="A date:",
        n=N,
        seed=6,
        temperature=1.0,
        max_tokens=16,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])"}},
    )
    for choice in regex.choices:
        text = choice.text
        assert len(text) == 7 and text[:2] == "20" and 1 <= int(text[5:]) <= 12, text
    picked = smollm2_openai.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=MESSAGES,
        n=N,
        seed=7,
        temperature=1.0,
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
    )
    assert {c.message.content for c in picked.choices} <= {"yes", "no", "maybe so"}


def test_constrained_logprobs_are_the_models(smollm2: httpx.Client) -> None:
    """Raw mode: the logprob of each constrained token is what the unconstrained model gives
    the same token after the same ids (scored by prompt_logprobs over prompt + output)."""
    prompt = smollm2.post("/tokenize", json={"prompt": "Colour:"}).json()["tokens"]
    sampling = {"max_tokens": 6, "temperature": 1.0, "seed": 3, "logprobs": 0}
    body = {
        "token_ids": prompt,
        "sampling_params": {**sampling, "structured_outputs": {"choice": [" teal", " mauve"]}},
    }
    out = smollm2.post("/inference/v1/generate", json=body).json()["choices"][0]
    ids = out["token_ids"]
    sampled = [entry["logprob"] for entry in out["logprobs"]["content"]]
    score = {
        "token_ids": prompt + ids,
        "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0},
    }
    scored = smollm2.post("/inference/v1/generate", json=score).json()["prompt_logprobs"]
    rows = scored[len(prompt) :]
    model = [row[str(token)]["logprob"] for row, token in zip(rows, ids, strict=True)]
    assert len(model) == len(sampled) >= 1
    assert max(abs(a - b) for a, b in zip(sampled, model, strict=True)) < 1e-4
