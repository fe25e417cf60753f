"""vLLM's extensions of the OpenAI routes that RL clients send (issue 18), over the fake engine:
``return_token_ids`` (TRL's VLLMClient, trace gateways), ``return_tokens_as_token_ids``
(AReaL), ``prompt_logprobs``, and ``echo`` on completions (AReaL's compute_logp)."""

from __future__ import annotations

from typing import Any

from tests.chat_fixtures import TOOLS
from tests.fast_app import FastApp, sse_chunks

EOS = 2
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def post(fast: FastApp, path: str, body: dict[str, Any]) -> Any:
    response = fast.client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_return_token_ids(fast_smollm2: FastApp) -> None:
    answer = fast_smollm2.tokenize("Paris.")
    fast_smollm2.engine.script = lambda *_: [*answer, EOS]
    body = {"messages": PARIS, "return_token_ids": True}
    prompt = post(fast_smollm2, "/tokenize", {"messages": PARIS})["tokens"]
    whole = post(fast_smollm2, "/v1/chat/completions", body)
    assert whole["prompt_token_ids"] == prompt
    assert whole["choices"][0]["token_ids"] == [*answer, EOS]
    chunks = sse_chunks(fast_smollm2.client, "/v1/chat/completions", {**body, "stream": True})
    deltas = [c for c in chunks if c["choices"]]
    assert deltas[0]["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in c for c in deltas[1:])
    assert [t for c in deltas for t in c["choices"][0]["token_ids"]] == [*answer, EOS]
    # Not asked: not there.
    plain = post(fast_smollm2, "/v1/chat/completions", {"messages": PARIS})
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_completions_return_token_ids_per_choice(fast_smollm2: FastApp) -> None:
    fast_smollm2.engine.script = lambda *_: [7, 8, EOS]
    body = {"prompt": [[1, 2, 3], [4, 5]], "return_token_ids": True, "max_tokens": 4}
    whole = post(fast_smollm2, "/v1/completions", body)
    assert [c["prompt_token_ids"] for c in whole["choices"]] == [[1, 2, 3], [4, 5]]
    assert [c["token_ids"] for c in whole["choices"]] == [[7, 8, EOS], [7, 8, EOS]]
    chunks = sse_chunks(fast_smollm2.client, "/v1/completions", {**body, "stream": True})
    firsts: dict[int, dict] = {}
    ids: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            firsts.setdefault(choice["index"], choice)
            ids[choice["index"]] += choice["token_ids"]
    assert firsts[0]["prompt_token_ids"] == [1, 2, 3] and firsts[1]["prompt_token_ids"] == [4, 5]
    assert ids == {0: [7, 8, EOS], 1: [7, 8, EOS]}


def test_tokens_as_token_ids(fast_smollm2: FastApp) -> None:
    fast_smollm2.engine.script = lambda *_: [7, 8, EOS]
    chat = post(
        fast_smollm2,
        "/v1/chat/completions",
        {
            "messages": PARIS,
            "logprobs": True,
            "top_logprobs": 2,
            "return_tokens_as_token_ids": True,
        },
    )
    content = chat["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == ["token_id:7", "token_id:8", "token_id:2"]
    assert content[0]["bytes"] == list(b"token_id:7")
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in content)
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    completion = post(
        fast_smollm2,
        "/v1/completions",
        {"prompt": [1, 2, 3], "logprobs": 1, "return_tokens_as_token_ids": True},
    )
    logprobs = completion["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["token_id:7", "token_id:8", "token_id:2"]
    assert logprobs["text_offset"] == [0, 10, 20]
    assert [list(top) for top in logprobs["top_logprobs"]] == [[t] for t in logprobs["tokens"]]


def test_prompt_logprobs_are_returned(fast_smollm2: FastApp) -> None:
    fast_smollm2.engine.script = lambda *_: [7, EOS]
    chat = post(fast_smollm2, "/v1/chat/completions", {"messages": PARIS, "prompt_logprobs": 1})
    prompt = post(fast_smollm2, "/tokenize", {"messages": PARIS})["tokens"]
    positions = chat["prompt_logprobs"]
    assert len(positions) == len(prompt) and positions[0] is None
    assert all(str(t) in p for t, p in zip(prompt[1:], positions[1:], strict=True))
    completion = post(fast_smollm2, "/v1/completions", {"prompt": [1, 2, 3], "prompt_logprobs": 0})
    assert len(completion["choices"][0]["prompt_logprobs"]) == 3


def test_echo_puts_the_prompt_first(fast_smollm2: FastApp) -> None:
    answer = fast_smollm2.tokenize(" Paris")
    fast_smollm2.engine.script = lambda *_: [*answer, EOS]
    prompt = "The capital of France is"
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 4}
    whole = post(fast_smollm2, "/v1/completions", body)["choices"][0]
    assert whole["text"].startswith(prompt) and whole["text"] == prompt + " Paris"
    logprobs = whole["logprobs"]
    ids = fast_smollm2.tokenize(prompt)
    assert len(logprobs["tokens"]) == len(ids) + len(answer) + 1  # prompt, " Paris", eos
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert "".join(logprobs["tokens"][: len(ids)]) == prompt
    assert logprobs["text_offset"][len(ids)] == len(prompt)
    # Streamed: the prompt comes with each choice's first chunk.
    chunks = sse_chunks(fast_smollm2.client, "/v1/completions", {**body, "stream": True})
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["text"]
    # echo with max_tokens 0: the prompt and its logprobs, nothing generated.
    scored = post(fast_smollm2, "/v1/completions", {**body, "max_tokens": 0})
    only = scored["choices"][0]
    assert only["text"] == prompt and len(only["logprobs"]["tokens"]) == len(ids)
    assert only["finish_reason"] == "length" and scored["usage"]["completion_tokens"] == 0


def test_max_tokens_zero_needs_echo(fast_smollm2: FastApp) -> None:
    response = fast_smollm2.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 0})
    assert response.status_code == 400
    assert "echo" in response.json()["error"]["message"]


THINK_AND_CALL = (
    "<think>\nThe user wants the weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
IM_END = 151645


def test_generate_output_modes(fast_qwen3: FastApp) -> None:
    """vLLM 0.33's ``output_mode``: one generate call answers the text, or the message derender
    would give (``parse_context``: the tools the prompt offered), streamed too."""
    output = [*fast_qwen3.tokenize(THINK_AND_CALL), IM_END]
    fast_qwen3.engine.script = lambda *_: output
    body: dict[str, Any] = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 64}}
    text = post(fast_qwen3, "/inference/v1/generate", {**body, "output_mode": "text"})
    assert text["choices"][0]["text"] == THINK_AND_CALL  # eos is not text
    derender_body = {**body, "output_mode": "derender", "parse_context": {"tools": TOOLS}}
    whole = post(fast_qwen3, "/inference/v1/generate", derender_body)["choices"][0]
    message = whole["message"]
    assert message["reasoning_content"] == "\nThe user wants the weather.\n"
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert whole["token_ids"] == output
    chunks = sse_chunks(
        fast_qwen3.client, "/inference/v1/generate", {**derender_body, "stream": True}
    )
    deltas = [choice["delta"] for c in chunks for choice in c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert sum(len(d.get("tool_calls") or []) for d in deltas) == 1
    # Without tools in the context, no call is parsed; tokens mode adds nothing.
    plain = post(fast_qwen3, "/inference/v1/generate", {**body, "output_mode": "derender"})
    assert "tool_calls" not in plain["choices"][0]["message"]
    ids_only = post(fast_qwen3, "/inference/v1/generate", body)["choices"][0]
    assert "text" not in ids_only and "message" not in ids_only


def test_n_zero_is_a_400_on_every_dialect(fast_smollm2: FastApp) -> None:
    """vLLM answers n=0 with a 400; it was a 200 without choices here (and a 500 on generate
    and SGLang's /generate once the job owned its choices)."""
    bodies = {
        "/inference/v1/generate": {"token_ids": [1, 2], "sampling_params": {"n": 0}},
        "/v1/chat/completions": {"messages": PARIS, "n": 0},
        "/v1/completions": {"prompt": "x", "n": 0},
        "/generate": {"text": "x", "sampling_params": {"n": 0}},
    }
    for path, body in bodies.items():
        response = fast_smollm2.client.post(path, json=body)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["param"] in ("n", "sampling_params"), path
    assert fast_smollm2.engine.calls == []
