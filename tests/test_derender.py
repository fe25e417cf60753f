"""Render and derender on the qwen3-tiny test server's app (parsers on)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.chat_fixtures import TOOLS
from tests.conftest import assert_error
from tests.fast_app import fast_client

IM_END = 151645
THINK_AND_CALL = (
    "<think>\nThe user wants the weather. 龘 needs a tool.\n</think>\n\n"
    "Let me check that for you.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>"
)
CHAT_REQUEST = {
    "messages": [{"role": "user", "content": "Weather in Paris?"}],
    "tools": TOOLS,
    "tool_choice": "auto",
}


# Nothing here runs the model (see ``tests.fast_app.fast_client``).
qwen3 = fast_client("fast_qwen3_app", "qwen3")


def ids_of(client: httpx.Client, text: str) -> list[int]:
    return client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()[
        "tokens"
    ]


def generate_response(token_ids: list[int], finish_reason: str = "stop", logprobs=None) -> dict:
    choice = {"index": 0, "token_ids": token_ids, "finish_reason": finish_reason}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return {"request_id": "chatcmpl-test", "choices": [choice]}


def fake_logprobs(token_ids: list[int], width: int = 2) -> dict:
    """Placeholder-form logprobs as /inference/v1/generate returns them."""
    content = []
    for position, token_id in enumerate(token_ids):
        alternatives = [token_id] + [
            (token_id + k * 7 + position) % 150000 for k in range(1, width)
        ]
        top = [
            {"token": f"token_id:{t}", "logprob": -0.1 * (k + 1), "bytes": None}
            for k, t in enumerate(alternatives)
        ]
        content.append(
            {"token": f"token_id:{token_id}", "logprob": -0.1, "bytes": None, "top_logprobs": top}
        )
    return {"content": content}


def test_chat_render_equals_tokenize_and_transformers(
    qwen3: httpx.Client, qwen3_hf_tokenizer
) -> None:
    body = {**CHAT_REQUEST, "chat_template_kwargs": {"enable_thinking": True}}
    rendered = qwen3.post("/v1/chat/completions/render", json=body).json()
    tokenized = qwen3.post("/tokenize", json=body).json()["tokens"]
    expected = qwen3_hf_tokenizer.apply_chat_template(
        CHAT_REQUEST["messages"],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        enable_thinking=True,
    )
    assert rendered["token_ids"] == tokenized == list(expected)
    assert rendered["features"] is None
    assert rendered["model"] == "qwen3-tiny"
    assert rendered["sampling_params"]["max_tokens"] == 4096 - len(tokenized)


def test_completion_render(qwen3: httpx.Client, qwen3_hf_tokenizer) -> None:
    body = {"prompt": ["Hello world", "龘🦩"], "max_tokens": 7, "temperature": 0.5}
    rendered = qwen3.post("/v1/completions/render", json=body).json()
    assert [r["token_ids"] for r in rendered] == [
        qwen3_hf_tokenizer("Hello world")["input_ids"],
        qwen3_hf_tokenizer("龘🦩")["input_ids"],
    ]
    assert all(r["request_id"].startswith("cmpl-") for r in rendered)
    assert rendered[0]["sampling_params"]["temperature"] == 0.5
    ids = qwen3.post("/v1/completions/render", json={"prompt": [9707, 1879]}).json()
    assert ids[0]["token_ids"] == [9707, 1879]


def test_render_refuses_prompts_that_do_not_fit(qwen3: httpx.Client) -> None:
    long = {"messages": [{"role": "user", "content": "word " * 5000}]}
    assert_error(qwen3.post("/v1/chat/completions/render", json=long), 400, "context length")
    too_many = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}
    assert_error(qwen3.post("/v1/chat/completions/render", json=too_many), 400, "context length")


def test_round_trip_reasoning_and_tool_call(qwen3: httpx.Client) -> None:
    rendered = qwen3.post("/v1/chat/completions/render", json=CHAT_REQUEST).json()
    output = ids_of(qwen3, THINK_AND_CALL) + [IM_END]
    body = {
        "generate_response": generate_response(output),
        "prompt_token_ids": rendered["token_ids"],
        "chat_request": CHAT_REQUEST,
    }
    data = qwen3.post("/v1/chat/completions/derender", json=body).json()
    (choice,) = data["choices"]
    message = choice["message"]
    assert message["reasoning_content"].strip() == "The user wants the weather. 龘 needs a tool."
    assert message["reasoning"] == message["reasoning_content"]
    assert message["content"].strip() == "Let me check that for you."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert choice["finish_reason"] == "tool_calls"
    assert data["object"] == "chat.completion" and data["id"] == "chatcmpl-test"
    assert data["usage"]["completion_tokens"] == len(output)
    assert data["usage"]["prompt_tokens"] == len(rendered["token_ids"])


def test_thinking_disabled_is_content(qwen3: httpx.Client) -> None:
    chat = {
        "messages": [{"role": "user", "content": "Hi"}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    output = ids_of(qwen3, "Hello! How can I help?") + [IM_END]
    body = {"generate_response": generate_response(output), "chat_request": chat}
    message = qwen3.post("/v1/chat/completions/derender", json=body).json()["choices"][0]["message"]
    assert message["content"] == "Hello! How can I help?"
    assert "reasoning_content" not in message and "tool_calls" not in message


def test_prompt_open_think_makes_truncated_reasoning(qwen3: httpx.Client) -> None:
    """The prompt ends inside <think> (R1-style): unclosed output is (truncated) reasoning."""
    prompt = qwen3.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    prompt_ids = prompt["tokens"] + ids_of(qwen3, "<think>\n")
    output = ids_of(qwen3, "Still thinking about it")
    body = {
        "generate_response": generate_response(output, "length"),
        "prompt_token_ids": prompt_ids,
        "chat_request": {"messages": [{"role": "user", "content": "Hi"}]},
    }
    message = qwen3.post("/v1/chat/completions/derender", json=body).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Still thinking about it"
    assert message["content"] is None


def test_without_chat_request_text_is_plain_content(qwen3: httpx.Client) -> None:
    output = ids_of(qwen3, THINK_AND_CALL) + [IM_END]
    body = {"generate_response": generate_response(output)}
    data = qwen3.post("/v1/chat/completions/derender", json=body).json()
    message = data["choices"][0]["message"]
    assert message["content"] == THINK_AND_CALL  # stop token dropped, nothing parsed
    assert data["choices"][0]["finish_reason"] == "stop"


TRICKY_TEXTS = [
    "龘🦩🫠",
    "naïve café — e\u0301 a\u0300 Z\u0351\u0352 漢字かなカナ 한국어 🇫🇷 👩‍👩‍👧",
    "🫠🫠🫠 龘龘 mixed ASCII and 🦩!",
]


def check_logprob_texts(client: httpx.Client, text: str) -> None:
    ids = ids_of(client, text)
    decoded = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    body = {"generate_response": generate_response(ids, "length", fake_logprobs(ids))}
    data = client.post("/v1/chat/completions/derender", json=body).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ids)
    if "\ufffd" not in decoded:
        assert all("\ufffd" not in entry["token"] for entry in content)
    assert "".join(entry["token"] for entry in content) == decoded
    joined = b"".join(bytes(entry["bytes"]) for entry in content)
    assert joined.decode("utf-8", "replace") == decoded
    for entry in content:
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert all(isinstance(alt["bytes"], list) for alt in entry["top_logprobs"])


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_logprob_tokens_are_byte_correct(qwen3: httpx.Client, text: str) -> None:
    check_logprob_texts(qwen3, text)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(min_size=1, max_size=60))
def test_logprob_tokens_are_byte_correct_for_any_text(qwen3: httpx.Client, text: str) -> None:
    check_logprob_texts(qwen3, text)


def test_integer_logprob_form_resolves(qwen3: httpx.Client) -> None:
    ids = ids_of(qwen3, "龘!")
    content = [
        {"token_id": t, "logprob": -1.0, "top_logprobs": [{"token_id": t, "logprob": -1.0}]}
        for t in ids
    ]
    body = {"generate_response": generate_response(ids, "length", {"content": content})}
    data = qwen3.post("/v1/chat/completions/derender", json=body).json()
    tokens = [entry["token"] for entry in data["choices"][0]["logprobs"]["content"]]
    assert tokens == ["", "龘", "!"]


def stream_derender(
    client: httpx.Client,
    output: list[int],
    chat_request: dict | None,
    prompt_ids: list[int] | None,
    logprobs: dict | None = None,
) -> dict:
    """Feed the choice one token per call; join the deltas."""
    state = None
    joined = {"content": "", "reasoning_content": "", "tool_calls": [], "tokens": []}
    finish = None
    for position, token_id in enumerate(output):
        last = position == len(output) - 1
        choice = {"index": 0, "token_ids": [token_id], "finish_reason": "stop" if last else None}
        if logprobs is not None:
            choice["logprobs"] = {"content": logprobs["content"][position : position + 1]}
        body = {
            "stream": True,
            "generate_chunk": {"request_id": "s", "choices": [choice]},
            "stream_state": state,
            "prompt_token_ids": prompt_ids,
            "chat_request": chat_request,
        }
        response = client.post("/v1/chat/completions/derender", json=body)
        assert response.status_code == 200, response.text
        data = response.json()
        state = data["stream_state"]
        (out,) = data["chunk"]["choices"]
        assert data["chunk"]["object"] == "chat.completion.chunk"
        delta = out["delta"]
        assert ("role" in delta) == (position == 0)
        joined["content"] += delta.get("content") or ""
        joined["reasoning_content"] += delta.get("reasoning_content") or ""
        joined["tool_calls"] += delta.get("tool_calls") or []
        if out["logprobs"]:
            joined["tokens"] += [e["token"] for e in out["logprobs"]["content"]]
        finish = out["finish_reason"]
    joined["finish_reason"] = finish
    return joined


@pytest.mark.parametrize(
    "text",
    [THINK_AND_CALL, "Plain answer with 龘🦩🫠 and <b>tags</b>.", "<think>\nhmm\n</think>\n\nok"],
)
def test_streaming_derender_equals_non_streaming(qwen3: httpx.Client, text: str) -> None:
    rendered = qwen3.post("/v1/chat/completions/render", json=CHAT_REQUEST).json()
    output = ids_of(qwen3, text) + [IM_END]
    logprobs = fake_logprobs(output)
    whole = qwen3.post(
        "/v1/chat/completions/derender",
        json={
            "generate_response": generate_response(output, "stop", logprobs),
            "prompt_token_ids": rendered["token_ids"],
            "chat_request": CHAT_REQUEST,
        },
    ).json()["choices"][0]
    streamed = stream_derender(qwen3, output, CHAT_REQUEST, rendered["token_ids"], logprobs)
    message = whole["message"]
    assert streamed["content"] == (message["content"] or "")
    assert streamed["reasoning_content"] == (message.get("reasoning_content") or "")
    assert [
        (c["function"]["name"], c["function"]["arguments"]) for c in streamed["tool_calls"]
    ] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
    assert streamed["finish_reason"] == whole["finish_reason"]
    assert streamed["tokens"] == [e["token"] for e in whole["logprobs"]["content"]]


def test_completion_derender(qwen3: httpx.Client) -> None:
    first = ids_of(qwen3, "Bonjour 🦩") + [IM_END]
    second = ids_of(qwen3, "Hola")
    body = {
        "generate_responses": [
            generate_response(first, "stop", fake_logprobs(first)),
            {
                "request_id": "r2",
                "choices": [
                    {"index": 0, "token_ids": second, "finish_reason": "length"},
                    {"index": 1, "token_ids": second, "finish_reason": "length"},
                ],
            },
        ],
        "prompt_tokens": [3, 4],
    }
    data = qwen3.post("/v1/completions/derender", json=body).json()
    assert data["object"] == "text_completion"
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert [c["text"] for c in data["choices"]] == ["Bonjour 🦩", "Hola", "Hola"]
    logprobs = data["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == "Bonjour 🦩<|im_end|>"
    assert logprobs["text_offset"][0] == 0
    assert data["usage"]["prompt_tokens"] == 7


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"generate_response": {"choices": [{"index": 0, "token_ids": []}]}},
            "choice 0 has empty or null token_ids",
        ),
        (
            {"generate_response": {"choices": [{"index": 0, "token_ids": None}]}},
            "choice 0 has empty or null token_ids",
        ),
        (
            {"generate_response": {"choices": [{"index": 0, "token_ids": [1] * 5000}]}},
            "max_model_len",
        ),
        ({"generate_response": {"choices": [{"index": 0, "token_ids": [-1]}]}}, "token_ids"),
        (
            {"generate_response": {"choices": [{"index": 0, "token_ids": [999999]}]}},
            "out of vocabulary",
        ),
        (
            {"generate_response": generate_response([1, 2], "stop", fake_logprobs([1]))},
            "logprob entries",
        ),
        (
            {"generate_response": generate_response([1], "stop", fake_logprobs([1], width=21))},
            "top_logprobs",
        ),
        (
            {
                "generate_response": generate_response(
                    [1], "stop", {"content": [{"token": "banana", "logprob": -1}]}
                )
            },
            "token_id:N",
        ),
        (
            {"generate_response": generate_response([1], "stop", {"content": [5]})},
            "logprobs.content.0: must be an object",
        ),
        (
            {
                "generate_response": generate_response(
                    [1], "stop", {"content": [{"token_id": 1, "logprob": "-1"}]}
                )
            },
            "logprobs.content.0.logprob: must be a number",
        ),
        (
            {
                "generate_response": generate_response(
                    [1], "stop", {"content": [{"token_id": 1, "logprob": 0, "top_logprobs": None}]}
                )
            },
            "logprobs.content.0.top_logprobs: must be a list",
        ),
        (
            {
                "generate_response": generate_response(
                    [1, 2],
                    "stop",
                    {
                        "content": [
                            {"token_id": 1, "logprob": 0},
                            {"token_id": 2, "logprob": 0, "top_logprobs": [{"logprob": 0}]},
                        ]
                    },
                )
            },
            "logprobs.content.1.top_logprobs.0.token: must be 'token_id:N'",
        ),
        (
            {
                "generate_response": generate_response(
                    [1], "stop", {"content": [{"token_id": -1, "logprob": 0}]}
                )
            },
            "logprobs.content.0.token_id: must be a non-negative integer",
        ),
        (
            {
                "generate_response": generate_response(
                    [1, 2], "stop", {"content": [{"token_id": 1, "logprob": 0}] * 2}
                )
            },
            "logprob entry 1 is for token 1, but the token there is 2",
        ),
        ({"generate_response": generate_response([5]), "model": "nope"}, "does not exist"),
        (
            {"stream": True, "generate_chunk": {"choices": []}, "stream_state": "%%%"},
            "stream_state",
        ),
    ],
)
def test_derender_bad_input(qwen3: httpx.Client, body: dict, message: str) -> None:
    status = 404 if message == "does not exist" else 400
    assert_error(qwen3.post("/v1/chat/completions/derender", json=body), status, message)


def test_bad_logprob_entry_on_completion_derender(qwen3: httpx.Client) -> None:
    response = generate_response([1], "length", {"content": [{"token_id": 1}]})
    body = {"generate_responses": [response]}
    error = assert_error(qwen3.post("/v1/completions/derender", json=body), 400, "choice 0")
    assert "logprobs.content.0.logprob: missing" in error["message"]
    assert error["param"] == "logprobs"


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions/derender", "/v1/completions/derender"])
def test_logprob_entry_forms_derender_alike(qwen3: httpx.Client, endpoint: str) -> None:
    """Placeholders only, integer ids only, or both (generate's form): the same answer."""
    ids = ids_of(qwen3, "Bonjour 龘🦩🫠 ok")
    generate_form = fake_logprobs(ids, width=3)
    integer_ids = {
        "content": [
            {
                "token_id": int(e["token"][9:]),
                "logprob": e["logprob"],
                "top_logprobs": [
                    {"token_id": int(a["token"][9:]), "logprob": a["logprob"]}
                    for a in e["top_logprobs"]
                ],
            }
            for e in generate_form["content"]
        ]
    }
    # token_id wins over the placeholder when both are there.
    both = {
        "content": [
            {
                **i,
                "token": "token_id:0",
                "rank": 1,
                "top_logprobs": [{**a, "token": "token_id:0"} for a in i["top_logprobs"]],
            }
            for i in integer_ids["content"]
        ]
    }
    rounded = json.loads(json.dumps(generate_form).replace("-0.1,", "-1,"))

    def derendered(logprobs: dict) -> dict:
        response = generate_response(ids, "length", logprobs)
        key = "generate_response" if "chat" in endpoint else "generate_responses"
        body = {key: response if "chat" in endpoint else [response]}
        data = qwen3.post(endpoint, json=body)
        assert data.status_code == 200, data.text
        return data.json()["choices"][0]["logprobs"]

    expected = derendered(generate_form)
    assert derendered(integer_ids) == expected
    assert derendered(both) == expected
    assert "-1.0" in json.dumps(derendered(rounded))  # integer logprobs come back as floats


def test_completion_derender_length_mismatch(qwen3: httpx.Client) -> None:
    body = {"generate_responses": [generate_response([1])], "prompt_tokens": [1, 2]}
    assert_error(qwen3.post("/v1/completions/derender", json=body), 400, "prompt_tokens length")
