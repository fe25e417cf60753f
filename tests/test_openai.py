"""/v1/chat/completions through the real `openai` client on the real SmolLM2 server: a real
answer, and the same request made step by step. Formatting, streaming, parsers and errors are in
``test_fast_openai``."""

from __future__ import annotations

import httpx
import openai
import pytest

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def render_generate_derender(client: httpx.Client, request: dict) -> tuple[dict, dict, dict]:
    """A chat request made step by step, as the chat route composes it."""
    rendered = client.post("/v1/chat/completions/render", json=request).json()
    generated = client.post("/inference/v1/generate", json=rendered).json()
    derendered = client.post(
        "/v1/chat/completions/derender",
        json={
            "generate_response": generated,
            "prompt_token_ids": rendered["token_ids"],
            "chat_request": request,
        },
    ).json()
    return rendered, generated, derendered


def test_chat_completion_answers_paris(
    smollm2_openai: openai.OpenAI, smollm2: httpx.Client
) -> None:
    completion = smollm2_openai.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=PARIS,
        temperature=0,
        max_tokens=24,
        logprobs=True,
        top_logprobs=2,
    )
    choice = completion.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert "<|im_end|>" not in choice.message.content
    tokens = [entry.token for entry in choice.logprobs.content]
    # The logprob tokens join to the content plus the stop token's text.
    assert "".join(tokens) == choice.message.content + "<|im_end|>"
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    # The same request made step by step: render -> generate -> derender.
    request = {"messages": PARIS, "temperature": 0, "max_tokens": 24}
    rendered, _, derendered = render_generate_derender(smollm2, request)
    assert derendered["choices"][0]["message"]["content"] == choice.message.content
    assert completion.usage.prompt_tokens == len(rendered["token_ids"])


def test_sampled_top_logprobs_equal_render_generate_derender(
    smollm2_openai: openai.OpenAI, smollm2: httpx.Client
) -> None:
    """One top-logprob rule: sampled at temperature 1, the chat route's lists (the sampled
    token first, then the most likely others) equal render -> generate -> derender's."""
    request = {"messages": PARIS, "temperature": 1.0, "seed": 11, "max_tokens": 48}
    request |= {"logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    completion = smollm2_openai.chat.completions.create(
        model="smollm2-135m-instruct",
        **{k: v for k, v in request.items() if k != "ignore_eos"},
        extra_body={"ignore_eos": True},
    )
    _, generated, derendered = render_generate_derender(smollm2, request)

    def lists(entries: list) -> list:
        return [
            [(top["token"], round(top["logprob"], 4)) for top in e["top_logprobs"]] for e in entries
        ]

    chat = [entry.model_dump() for entry in completion.choices[0].logprobs.content]
    composed = derendered["choices"][0]["logprobs"]["content"]
    sampled = generated["choices"][0]["logprobs"]["content"]
    # Long enough to sample tokens that are not the most likely: the rule matters there.
    assert any(entry["rank"] > 1 for entry in sampled)
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in chat)
    assert lists(chat) == lists(composed)


def test_echo_logprobs_equal_generate_prompt_logprobs(
    smollm2_openai: openai.OpenAI, smollm2: httpx.Client
) -> None:
    """AReaL's compute_logp: ``echo`` + ``logprobs`` with ``max_tokens: 0`` scores the given
    ids; the numbers are generate's ``prompt_logprobs`` (a transformers forward's, see
    test_generate) for the same ids."""
    ids = smollm2.post("/tokenize", json={"messages": PARIS}).json()["tokens"]
    scored = smollm2_openai.completions.create(
        model="smollm2-135m-instruct",
        prompt=ids,
        max_tokens=0,
        echo=True,
        logprobs=1,
        extra_body={"return_token_ids": True},
    ).choices[0]
    assert scored.model_extra["prompt_token_ids"] == ids
    assert scored.model_extra["token_ids"] == []
    reference = smollm2.post(
        "/inference/v1/generate",
        json={"token_ids": ids, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}},
    ).json()["prompt_logprobs"]
    token_logprobs = scored.logprobs.token_logprobs
    assert len(token_logprobs) == len(ids) and token_logprobs[0] is None
    for value, position, token_id in zip(token_logprobs[1:], reference[1:], ids[1:], strict=True):
        assert value == pytest.approx(position[str(token_id)]["logprob"], abs=1e-5)
    # Generating after the echo: the prompt's text, then the output's, ids apart.
    echoed = smollm2_openai.completions.create(
        model="smollm2-135m-instruct",
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        echo=True,
        extra_body={"return_token_ids": True},
    ).choices[0]
    assert echoed.text.startswith("The capital of France is")
    assert len(echoed.model_extra["token_ids"]) == 4
