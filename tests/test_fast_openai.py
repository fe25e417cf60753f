"""/v1/chat/completions and /v1/completions over the fake engine, through the real ``openai``
client and as JSON: content, logprobs, stop strings, streaming, reasoning and tool calls with
Qwen3's parsers, errors, and the promise that a chat completion is render -> generate ->
derender."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.chat_fixtures import TOOLS
from tests.conftest import API_KEY
from tests.fake_engine import Step
from tests.fast_app import FastApp, sse_chunks

EOS = 2  # SmolLM2's <|im_end|>
IM_END = 151645  # Qwen3's
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
SMOLLM2 = "smollm2-135m-instruct"
THINK_AND_CALL = (
    "<think>\nThe user wants the weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>"
)


def openai_client(fast: FastApp, api_key: str = "unused") -> openai.OpenAI:
    """The real OpenAI client, sending through the app's TestClient."""
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key=api_key, http_client=fast.client, max_retries=0
    )


def post(fast: FastApp, path: str, body: dict[str, Any]) -> Any:
    response = fast.client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def composed(fast: FastApp, body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion made step by step: render -> generate -> derender."""
    rendered = post(fast, "/v1/chat/completions/render", body)
    generated = post(fast, "/inference/v1/generate", rendered)
    derender = {
        "generate_response": generated,
        "prompt_token_ids": rendered["token_ids"],
        "chat_request": body,
    }
    return post(fast, "/v1/chat/completions/derender", derender)


def test_chat_completion(fast_smollm2: FastApp) -> None:
    answer = fast_smollm2.tokenize("The capital of France is Paris.")
    fast_smollm2.engine.script = lambda *_: [*answer, EOS]
    completion = openai_client(fast_smollm2).chat.completions.create(
        model=SMOLLM2, messages=PARIS, logprobs=True, top_logprobs=2
    )
    choice = completion.choices[0]
    assert choice.message.content == "The capital of France is Paris."
    assert choice.finish_reason == "stop"
    tokens = [entry.token for entry in choice.logprobs.content]
    # The logprob tokens join to the content plus the stop token's text.
    assert "".join(tokens) == choice.message.content + "<|im_end|>"
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    rendered = post(fast_smollm2, "/v1/chat/completions/render", {"messages": PARIS})
    assert fast_smollm2.engine.calls[0].prompt_token_ids == rendered["token_ids"]
    assert completion.usage.prompt_tokens == len(rendered["token_ids"])
    assert completion.usage.completion_tokens == len(answer) + 1
    assert completion.id.startswith("chatcmpl-") and completion.model == SMOLLM2
    derendered = composed(fast_smollm2, {"messages": PARIS})["choices"][0]
    assert derendered["message"]["content"] == choice.message.content


def test_chat_completion_streaming(fast_smollm2: FastApp) -> None:
    answer = fast_smollm2.tokenize("The capital of France is Paris.")
    # Several tokens per engine output, as a busy engine sends them.
    fast_smollm2.engine.script = lambda *_: [answer[:3], answer[3:4], [*answer[4:], EOS]]
    client = openai_client(fast_smollm2)
    whole = client.chat.completions.create(model=SMOLLM2, messages=PARIS).choices[0]
    chunks = list(
        client.chat.completions.create(
            model=SMOLLM2, messages=PARIS, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(answer) + 1


@pytest.mark.parametrize(
    ("include", "content"),
    [(False, "The capital of France is "), (True, "The capital of France is Paris")],
)
@pytest.mark.parametrize("stream", [False, True])
def test_chat_stop_strings(
    fast_smollm2: FastApp, include: bool, content: str, stream: bool
) -> None:
    """The text ends where the stop string starts (or ends, with include_stop_str_in_output);
    a streamed choice holds back what may start one and sends the same text."""
    ids = fast_smollm2.tokenize("The capital of France is Paris. It is big.")
    fast_smollm2.engine.script = lambda *_: [*ids, EOS]
    body = {"messages": PARIS, "stop": ["Paris"], "include_stop_str_in_output": include}
    if stream:
        chunks = sse_chunks(fast_smollm2.client, "/v1/chat/completions", {**body, "stream": True})
        deltas = [c["choices"][0] for c in chunks]
        assert "".join(d["delta"].get("content") or "" for d in deltas) == content
        assert deltas[-1]["finish_reason"] == "stop"
    else:
        choice = post(fast_smollm2, "/v1/chat/completions", body)["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (content, "stop")


def test_completions_plain_and_streaming(fast_smollm2: FastApp) -> None:
    answers = {
        tuple(fast_smollm2.tokenize("The capital of France is")): " Paris. It is big.",
        tuple(fast_smollm2.tokenize("One, two,")): " three, four, five.",
    }
    scripts = {prompt: fast_smollm2.tokenize(text) for prompt, text in answers.items()}
    fast_smollm2.engine.script = lambda _, prompt, __: scripts[tuple(prompt)]
    client = openai_client(fast_smollm2)
    result = client.completions.create(
        model=SMOLLM2, prompt=["The capital of France is", "One, two,"], max_tokens=4, logprobs=1
    )
    assert [c.index for c in result.choices] == [0, 1]
    assert [c.text for c in result.choices] == [" Paris. It is", " three, four,"]
    assert all(c.finish_reason == "length" for c in result.choices)
    assert "".join(result.choices[0].logprobs.tokens) == result.choices[0].text
    assert result.usage.completion_tokens == 8
    streamed = client.completions.create(
        model=SMOLLM2, prompt="The capital of France is", max_tokens=4, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == result.choices[0].text


def test_completions_default_to_16_tokens_as_vllm(fast_smollm2: FastApp) -> None:
    """Completions without ``max_tokens`` get 16 (vLLM's and OpenAI's default; it ran to the
    context limit), an explicit null what fits; chat keeps what fits."""
    room = post(fast_smollm2, "/tokenize", {"prompt": "Hi"})
    fits = room["max_model_len"] - room["count"]
    render = "/v1/completions/render"
    assert post(fast_smollm2, render, {"prompt": "Hi"})[0]["sampling_params"]["max_tokens"] == 16
    nulled = post(fast_smollm2, render, {"prompt": "Hi", "max_tokens": None})
    assert nulled[0]["sampling_params"]["max_tokens"] == fits
    fast_smollm2.engine.script = lambda *_: [7] * 40
    completion = post(fast_smollm2, "/v1/completions", {"prompt": "Hi"})
    assert completion["usage"]["completion_tokens"] == 16
    assert fast_smollm2.engine.calls[-1].sampling.max_tokens == 16
    chat = post(fast_smollm2, "/v1/chat/completions/render", {"messages": PARIS})
    assert chat["sampling_params"]["max_tokens"] == room["max_model_len"] - len(chat["token_ids"])


def test_completions_number_choices_prompt_by_prompt(fast_smollm2: FastApp) -> None:
    """Prompt i's choice j is choice i * n + j, whether streamed or not."""
    fast_smollm2.engine.script = lambda _, prompt, sampling: [prompt[0], 1000 + sampling.seed]
    body = {"prompt": [[504], [3458]], "n": 2, "seed": 0, "max_tokens": 2}
    choices = post(fast_smollm2, "/v1/completions", body)["choices"]
    streamed: dict[int, list[str]] = {}
    for chunk in sse_chunks(fast_smollm2.client, "/v1/completions", {**body, "stream": True}):
        for choice in chunk["choices"]:
            streamed.setdefault(choice["index"], []).append(choice["text"])
    texts = [
        post(fast_smollm2, "/detokenize", {"tokens": ids})["prompt"]
        for ids in ([504, 1000], [504, 1001], [3458, 1000], [3458, 1001])
    ]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == texts
    assert {index: "".join(parts) for index, parts in streamed.items()} == dict(enumerate(texts))


def test_chat_with_reasoning_and_tools(fast_qwen3: FastApp) -> None:
    output = [*fast_qwen3.tokenize(THINK_AND_CALL), IM_END]
    fast_qwen3.engine.script = lambda *_: output
    client = openai_client(fast_qwen3, API_KEY)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    completion = client.chat.completions.create(
        model="qwen3-alias", messages=messages, tools=TOOLS, n=2, seed=3
    )
    assert [c.index for c in completion.choices] == [0, 1]
    for choice in completion.choices:
        message = choice.model_dump()["message"]
        assert message["content"] is None
        assert (
            message["reasoning_content"]
            == message["reasoning"]
            == "\nThe user wants the weather.\n"
        )
        (call,) = message["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
        assert choice.finish_reason == "tool_calls"
    stream = client.chat.completions.create(
        model="qwen3-tiny", messages=messages, tools=TOOLS, stream=True
    )
    deltas = [c.choices[0].model_dump() for c in stream if c.choices]
    reasoning = "".join(d["delta"].get("reasoning_content") or "" for d in deltas)
    assert reasoning == "\nThe user wants the weather.\n"
    calls = [call for d in deltas for call in d["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    arguments = "".join(call["function"].get("arguments") or "" for call in calls)
    assert json.loads(arguments) == {"city": "Paris", "unit": "celsius"}
    assert deltas[-1]["finish_reason"] == "tool_calls"
    # Without tools offered the call stays in the content.
    plain = client.chat.completions.create(model="qwen3-tiny", messages=messages)
    assert "<tool_call>" in plain.choices[0].message.content
    assert plain.choices[0].finish_reason == "stop"


def test_tool_call_completion_equals_render_generate_derender(fast_qwen3: FastApp) -> None:
    output = [*fast_qwen3.tokenize(THINK_AND_CALL), IM_END]
    fast_qwen3.engine.script = lambda *_: output
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
    completion = post(fast_qwen3, "/v1/chat/completions", body)
    derendered = composed(fast_qwen3, body)

    def without_call_ids(message: dict) -> str:
        for call in message.get("tool_calls", []):
            call.pop("id")  # fresh per response
        return json.dumps(message, sort_keys=True)

    assert without_call_ids(derendered["choices"][0]["message"]) == without_call_ids(
        completion["choices"][0]["message"]
    )
    assert derendered["choices"][0]["finish_reason"] == completion["choices"][0]["finish_reason"]


def test_openai_errors(fast_smollm2: FastApp, fast_qwen3: FastApp) -> None:
    client = openai_client(fast_smollm2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=PARIS)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=SMOLLM2, messages=[])
    assert "messages" in str(error.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=SMOLLM2, messages=PARIS, max_tokens=10**6)
    with pytest.raises(openai.AuthenticationError):
        openai_client(fast_qwen3, "wrong").chat.completions.create(
            model="qwen3-tiny", messages=PARIS
        )
    assert fast_smollm2.engine.calls == [] and fast_qwen3.engine.calls == []
    assert fast_smollm2.abort_all() == 0 and fast_qwen3.abort_all() == 0


def test_chat_top_logprobs_equal_render_generate_derender(fast_smollm2: FastApp) -> None:
    """A token sampled at rank 5: the chat route's top_logprobs equal what render -> generate
    -> derender gives, and both follow vLLM's rule (the sampled token, then the most likely
    others, k in all)."""
    answer = fast_smollm2.tokenize(" Paris")
    top = tuple((token, -0.1 - i) for i, token in enumerate(fast_smollm2.tokenize(" a b c d")))
    sampled = Step(answer[0], logprob=-6.0, rank=5, top=top)
    fast_smollm2.engine.script = lambda *_: [sampled, EOS]
    body = {"messages": PARIS, "logprobs": True, "top_logprobs": 2}

    def top_lists(response: dict[str, Any]) -> list[list[tuple[str, float]]]:
        content = response["choices"][0]["logprobs"]["content"]
        return [[(t["token"], t["logprob"]) for t in entry["top_logprobs"]] for entry in content]

    chat = top_lists(post(fast_smollm2, "/v1/chat/completions", body))
    assert chat == top_lists(composed(fast_smollm2, body))
    assert chat[0] == [(" Paris", -6.0), (" a", -0.1)]
