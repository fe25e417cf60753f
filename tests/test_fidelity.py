"""Where tokenwire must match vLLM's text: null content, stop strings, special tokens, UTF-8.

Each test states vLLM's behaviour; the real servers answer over HTTP.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.chat_fixtures import TOOLS
from tests.test_derender import fake_logprobs, generate_response, ids_of

SMOL_MODEL = "smollm2-135m-instruct"
SMOL_IM_START = 1
SMOL_IM_END = 2
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
FRANCE = "The capital of France is"
# Greedy SmolLM2 writes " Paris" as one token: "ari" starts and ends inside it.
STOP = "ari"
TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def cut(text: str, stop: str, include: bool) -> str:
    """vLLM's text for a stop string: up to its first occurrence, with it when asked."""
    end = text.index(stop) + (len(stop) if include else 0)
    return text[:end]


def assert_stop_inside_token(text: str, offsets: list[int]) -> None:
    """The test is only meaningful when the stop string neither starts nor ends on a boundary."""
    start = text.index(STOP)
    assert start not in offsets and start + len(STOP) not in offsets, (text, offsets)


# 1. Null or missing assistant content (a tool-call-only turn) renders as "".


def tool_turn(assistant_content: dict) -> dict:
    assistant = {"role": "assistant", "tool_calls": [TOOL_CALL], **assistant_content}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        assistant,
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    return {"messages": messages, "tools": TOOLS}


def prompt_ids(client: httpx.Client, path: str, body: dict) -> list[int]:
    """The prompt's ids (or, for a chat completion, its length) as each endpoint reports them."""
    if path == "/v1/chat/completions":
        body = {**body, "max_tokens": 1, "temperature": 0}
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    if path == "/tokenize":
        return data["tokens"]
    if path == "/v1/chat/completions/render":
        return data["token_ids"]
    return [data["usage"]["prompt_tokens"]]


@pytest.mark.parametrize("content", [{"content": None}, {}], ids=["null", "missing"])
@pytest.mark.parametrize(
    "path", ["/tokenize", "/v1/chat/completions/render", "/v1/chat/completions"]
)
def test_null_or_missing_assistant_content_is_empty(
    qwen3: httpx.Client, path: str, content: dict
) -> None:
    """vLLM reads content null (derender's tool-call-only turn) or absent as ""."""
    expected = prompt_ids(qwen3, path, tool_turn({"content": ""}))
    assert prompt_ids(qwen3, path, tool_turn(content)) == expected


# 2. Stop strings cut the text where they occur, even inside a token.


@pytest.fixture(scope="module")
def greedy_completion(smollm2_openai: openai.OpenAI) -> str:
    result = smollm2_openai.completions.create(
        model=SMOL_MODEL, prompt=FRANCE, max_tokens=8, temperature=0, logprobs=0
    )
    choice = result.choices[0]
    assert_stop_inside_token(choice.text, choice.logprobs.text_offset)
    return choice.text


@pytest.fixture(scope="module")
def greedy_chat(smollm2: httpx.Client) -> str:
    body = {"messages": PARIS, "max_tokens": 24, "temperature": 0, "logprobs": True}
    choice = smollm2.post("/v1/chat/completions", json=body).json()["choices"][0]
    text = choice["message"]["content"]
    offsets, position = [], 0
    for entry in choice["logprobs"]["content"]:
        offsets.append(position)
        position += len(entry["token"])
    assert_stop_inside_token(text, offsets)
    return text


@pytest.mark.parametrize("include", [False, True])
def test_completions_stop_string_cuts_text(
    smollm2_openai: openai.OpenAI, greedy_completion: str, include: bool
) -> None:
    request = {
        "model": SMOL_MODEL,
        "prompt": FRANCE,
        "max_tokens": 8,
        "temperature": 0,
        "stop": [STOP],
        "extra_body": {"include_stop_str_in_output": include},
    }
    expected = cut(greedy_completion, STOP, include)
    choice = smollm2_openai.completions.create(**request).choices[0]
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    chunks = [c for c in smollm2_openai.completions.create(**request, stream=True) if c.choices]
    streamed = "".join(c.choices[0].text for c in chunks)
    assert (streamed, chunks[-1].choices[0].finish_reason) == (expected, "stop")


@pytest.mark.parametrize("include", [False, True])
def test_chat_stop_string_cuts_text(
    smollm2_openai: openai.OpenAI, greedy_chat: str, include: bool
) -> None:
    request = {
        "model": SMOL_MODEL,
        "messages": PARIS,
        "max_tokens": 24,
        "temperature": 0,
        "stop": [STOP],
        "extra_body": {"include_stop_str_in_output": include},
    }
    expected = cut(greedy_chat, STOP, include)
    choice = smollm2_openai.chat.completions.create(**request).choices[0]
    assert (choice.message.content, choice.finish_reason) == (expected, "stop")
    chunks = [
        c for c in smollm2_openai.chat.completions.create(**request, stream=True) if c.choices
    ]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (streamed, chunks[-1].choices[0].finish_reason) == (expected, "stop")


def test_chat_derender_stop_string_cuts_text(smollm2: httpx.Client, greedy_chat: str) -> None:
    """render -> generate -> derender gives the chat completion's text, cut at the stop string."""
    body = {"messages": PARIS, "max_tokens": 24, "temperature": 0, "stop": [STOP]}
    rendered = smollm2.post("/v1/chat/completions/render", json=body).json()
    generated = smollm2.post("/inference/v1/generate", json=rendered).json()
    for include in (False, True):
        chat_request = {**body, "include_stop_str_in_output": include}
        data = smollm2.post(
            "/v1/chat/completions/derender",
            json={
                "generate_response": generated,
                "prompt_token_ids": rendered["token_ids"],
                "chat_request": chat_request,
            },
        ).json()
        (choice,) = data["choices"]
        expected = cut(greedy_chat, STOP, include)
        assert (choice["message"]["content"], choice["finish_reason"]) == (expected, "stop")


def test_completion_derender_stop_string_cuts_text(
    smollm2: httpx.Client, greedy_completion: str
) -> None:
    body = {"prompt": FRANCE, "max_tokens": 8, "temperature": 0, "stop": [STOP]}
    (rendered,) = smollm2.post("/v1/completions/render", json=body).json()
    generated = smollm2.post("/inference/v1/generate", json=rendered).json()
    for include in (False, True):
        completion_request = {**body, "include_stop_str_in_output": include}
        data = smollm2.post(
            "/v1/completions/derender",
            json={
                "generate_responses": [generated],
                "prompt_token_ids": [rendered["token_ids"]],
                "completion_request": completion_request,
            },
        ).json()
        (choice,) = data["choices"]
        expected = cut(greedy_completion, STOP, include)
        assert (choice["text"], choice["finish_reason"]) == (expected, "stop")


def test_generate_reports_stop_reason(smollm2: httpx.Client) -> None:
    """vLLM's choice carries stop_reason: the stop string, the stop token id, or null."""
    paris_ids = smollm2.post("/tokenize", json={"messages": PARIS}).json()["tokens"]

    def choice(**sampling: object) -> dict:
        body = {"token_ids": paris_ids, "sampling_params": {"temperature": 0, **sampling}}
        response = smollm2.post("/inference/v1/generate", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    by_eos = choice(max_tokens=24)
    assert by_eos["token_ids"][-1] == SMOL_IM_END
    assert (by_eos["finish_reason"], by_eos.get("stop_reason", "absent")) == ("stop", None)
    by_string = choice(max_tokens=24, stop=[STOP])
    assert (by_string["finish_reason"], by_string.get("stop_reason")) == ("stop", STOP)
    stop_id = by_eos["token_ids"][-2]  # "." after Paris; it does not occur earlier
    by_id = choice(max_tokens=24, stop_token_ids=[stop_id])
    assert by_id["token_ids"][-1] == stop_id
    assert (by_id["finish_reason"], by_id.get("stop_reason")) == ("stop", stop_id)
    by_length = choice(max_tokens=2)
    assert (by_length["finish_reason"], by_length.get("stop_reason", "absent")) == (
        "length",
        None,
    )


# 3. skip_special_tokens=false keeps special tokens' text everywhere.


def test_completions_streaming_keeps_special_tokens(smollm2_openai: openai.OpenAI) -> None:
    """With ignore_eos the model runs past <|im_end|>; both forms keep every special token."""
    request = {
        "model": SMOL_MODEL,
        "prompt": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n",
        "max_tokens": 16,
        "temperature": 0,
        "extra_body": {"skip_special_tokens": False, "ignore_eos": True},
    }
    whole = smollm2_openai.completions.create(**request).choices[0].text
    assert "<|im_end|>" in whole
    streamed = "".join(
        c.choices[0].text
        for c in smollm2_openai.completions.create(**request, stream=True)
        if c.choices
    )
    assert streamed == whole


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_derender_honours_skip_special_tokens(smollm2: httpx.Client, endpoint: str) -> None:
    """The ending stop token's text never appears; other special tokens do when not skipped."""
    output = ids_of(smollm2, "Hello") + [SMOL_IM_START] + ids_of(smollm2, "world") + [SMOL_IM_END]
    generated = generate_response(output)
    texts = {}
    for skip in (True, False):
        if endpoint == "chat":
            chat_request = {"messages": PARIS, "skip_special_tokens": skip}
            body = {"generate_response": generated, "chat_request": chat_request}
            choice = smollm2.post("/v1/chat/completions/derender", json=body).json()["choices"][0]
            texts[skip] = choice["message"]["content"]
        else:
            completion_request = {"prompt": FRANCE, "skip_special_tokens": skip}
            body = {"generate_responses": [generated], "completion_request": completion_request}
            choice = smollm2.post("/v1/completions/derender", json=body).json()["choices"][0]
            texts[skip] = choice["text"]
    assert texts == {True: "Helloworld", False: "Hello<|im_start|>world"}


# 4. Streaming chat derender keeps the first chunk's chat_request (its stop_token_ids).


def stream_chat_derender(
    client: httpx.Client,
    chunks: list[tuple[list[int], str | None]],
    chat_request: dict,
    prompt_token_ids: list[int] | None = None,
    logprobs: dict | None = None,
) -> tuple[str, list[str]]:
    """Feed the chunks, carrying stream_state; chat_request and prompt go with the first only.

    Returns the joined content deltas and logprob tokens.
    """
    state, content, tokens, position = None, "", [], 0
    for number, (token_ids, finish_reason) in enumerate(chunks):
        choice: dict = {"index": 0, "token_ids": token_ids, "finish_reason": finish_reason}
        if logprobs is not None:
            choice["logprobs"] = {
                "content": logprobs["content"][position : position + len(token_ids)]
            }
        position += len(token_ids)
        first = number == 0
        body = {
            "stream": True,
            "generate_chunk": {"request_id": "stream", "choices": [choice]},
            "stream_state": state,
            "chat_request": chat_request if first else None,
            "prompt_token_ids": prompt_token_ids if first else None,
        }
        response = client.post("/v1/chat/completions/derender", json=body)
        assert response.status_code == 200, response.text
        data = response.json()
        state = data["stream_state"]
        (out,) = data["chunk"]["choices"]
        content += out["delta"].get("content") or ""
        if out["logprobs"]:
            tokens += [entry["token"] for entry in out["logprobs"]["content"]]
    return content, tokens


def test_streaming_chat_derender_remembers_stop_token_ids(smollm2: httpx.Client) -> None:
    bang = ids_of(smollm2, "!")
    chat_request = {"messages": PARIS, "stop_token_ids": bang}
    chunks = [(ids_of(smollm2, "Hello"), None), (ids_of(smollm2, " world") + bang, "stop")]
    content, _ = stream_chat_derender(smollm2, chunks, chat_request)
    assert content == "Hello world"


# 5. A prompt that ends inside a UTF-8 character: the output's first token completes it.

SPLIT_CHARACTERS = {"龘": ([82912], [246]), "🦩": ([123918], [102])}
NO_THINKING = {
    "messages": [{"role": "user", "content": "Hi"}],
    "chat_template_kwargs": {"enable_thinking": False},
}


def split_case(client: httpx.Client, prompt: list[int], character: str) -> tuple[list, list]:
    head, tail = SPLIT_CHARACTERS[character]
    assert ids_of(client, character) == head + tail
    return prompt + head, tail + ids_of(client, " ok")


def assert_content_matches_tokens(content: str, tokens: list[str]) -> None:
    assert not content.startswith("\ufffd"), content
    assert content == "".join(tokens)
    assert content.endswith(" ok")


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("character", list(SPLIT_CHARACTERS), ids=["cjk", "emoji"])
def test_chat_derender_after_prompt_split_inside_character(
    qwen3: httpx.Client, character: str, streaming: bool
) -> None:
    rendered = qwen3.post("/tokenize", json=NO_THINKING).json()["tokens"]
    prompt, output = split_case(qwen3, rendered, character)
    logprobs = fake_logprobs(output)
    if streaming:
        chunks = [([token_id], None) for token_id in output[:-1]] + [([output[-1]], "length")]
        content, tokens = stream_chat_derender(qwen3, chunks, NO_THINKING, prompt, logprobs)
    else:
        body = {
            "generate_response": generate_response(output, "length", logprobs),
            "prompt_token_ids": prompt,
            "chat_request": NO_THINKING,
        }
        (choice,) = qwen3.post("/v1/chat/completions/derender", json=body).json()["choices"]
        content = choice["message"]["content"]
        tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
    assert_content_matches_tokens(content, tokens)


@pytest.mark.parametrize("character", list(SPLIT_CHARACTERS), ids=["cjk", "emoji"])
def test_completion_derender_after_prompt_split_inside_character(
    qwen3: httpx.Client, character: str
) -> None:
    prompt, output = split_case(qwen3, ids_of(qwen3, "Say "), character)
    body = {
        "generate_responses": [generate_response(output, "length", fake_logprobs(output))],
        "prompt_token_ids": [prompt],
        "completion_request": {"prompt": prompt, "logprobs": 1},
    }
    (choice,) = qwen3.post("/v1/completions/derender", json=body).json()["choices"]
    assert_content_matches_tokens(choice["text"], choice["logprobs"]["tokens"])
