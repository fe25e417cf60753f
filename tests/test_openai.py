"""/v1/chat/completions and /v1/completions through the real `openai` client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.chat_fixtures import TOOLS
from tests.conftest import Server

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


def test_chat_completion_streaming(smollm2_openai: openai.OpenAI) -> None:
    whole = (
        smollm2_openai.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=PARIS,
            temperature=0,
            max_tokens=24,
        )
        .choices[0]
        .message.content
    )
    stream = smollm2_openai.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=PARIS,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_completions_plain_and_streaming(smollm2_openai: openai.OpenAI) -> None:
    result = smollm2_openai.completions.create(
        model="smollm2-135m-instruct",
        prompt=["The capital of France is", "One, two,"],
        max_tokens=6,
        temperature=0,
        logprobs=1,
    )
    assert [c.index for c in result.choices] == [0, 1]
    assert all(c.text for c in result.choices)
    assert "".join(result.choices[0].logprobs.tokens) == result.choices[0].text
    streamed = smollm2_openai.completions.create(
        model="smollm2-135m-instruct",
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == result.choices[0].text


def test_chat_with_reasoning_and_tools(qwen3_openai: openai.OpenAI) -> None:
    """The tiny random model says nothing sensible, but the parsers' plumbing must hold."""
    completion = qwen3_openai.chat.completions.create(
        model="qwen3-alias",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        temperature=0,
        max_tokens=16,
        n=2,
        seed=3,
    )
    assert [c.index for c in completion.choices] == [0, 1]
    for choice in completion.choices:
        assert choice.finish_reason in ("length", "stop", "tool_calls")
    stream = qwen3_openai.chat.completions.create(
        model="qwen3-tiny",
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0,
        max_tokens=16,
        stream=True,
    )
    streamed = [c for c in stream if c.choices]
    whole = (
        qwen3_openai.chat.completions.create(
            model="qwen3-tiny",
            messages=[{"role": "user", "content": "Hi"}],
            temperature=0,
            max_tokens=16,
        )
        .choices[0]
        .message
    )
    content = "".join(c.choices[0].delta.content or "" for c in streamed)
    assert content == (whole.content or "")


def test_openai_errors(smollm2_openai: openai.OpenAI, qwen3_server: Server) -> None:
    with pytest.raises(openai.NotFoundError):
        smollm2_openai.chat.completions.create(model="gpt-9", messages=PARIS)
    with pytest.raises(openai.BadRequestError) as error:
        smollm2_openai.chat.completions.create(model="smollm2-135m-instruct", messages=[])
    assert "messages" in str(error.value)
    with pytest.raises(openai.BadRequestError):
        smollm2_openai.chat.completions.create(
            model="smollm2-135m-instruct", messages=PARIS, max_tokens=10**6
        )
    anonymous = openai.OpenAI(base_url=f"{qwen3_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.chat.completions.create(model="qwen3-tiny", messages=PARIS)


def test_tool_call_finish_reason_end_to_end(qwen3: httpx.Client) -> None:
    """Derender of a chat completion's own ids agrees with the completion (tools offered)."""
    body = {
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 12,
    }
    completion = qwen3.post("/v1/chat/completions", json=body).json()
    rendered = qwen3.post("/v1/chat/completions/render", json=body).json()
    generated = qwen3.post("/inference/v1/generate", json=rendered).json()
    derendered = qwen3.post(
        "/v1/chat/completions/derender",
        json={
            "generate_response": generated,
            "prompt_token_ids": rendered["token_ids"],
            "chat_request": body,
        },
    ).json()

    def without_call_ids(message: dict) -> str:
        for call in message.get("tool_calls", []):
            call.pop("id")  # fresh per response
        return json.dumps(message, sort_keys=True)

    assert without_call_ids(derendered["choices"][0]["message"]) == without_call_ids(
        completion["choices"][0]["message"]
    )
