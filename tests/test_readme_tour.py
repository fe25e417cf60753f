"""README's quick tour, run: every curl in it against the default model (what ``make serve``
serves), each answer checked for what the tour means by it. The tour once detokenized Qwen's
ids for "Hello world" on SmolLM2 (" juice influ"); a curl added without a check fails here."""

from __future__ import annotations

import itertools
import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Server

README = Path(__file__).resolve().parents[1] / "README.md"


@dataclass
class Curl:
    path: str
    headers: dict[str, str]
    body: Any  # None: a GET

    def __str__(self) -> str:
        return f"{self.path} {json.dumps(self.body)[:80] if self.body is not None else ''}"


def tour() -> list[Curl]:
    """The curls of README's "A quick tour" block, parsed as a shell reads them."""
    text = README.read_text()
    section = text[text.index("## A quick tour") :]
    start = section.index("```sh\n") + len("```sh\n")
    block = section[start : section.index("\n```", start)]
    variables = dict(re.findall(r"^(\w+)='([^']*)'$", block, re.MULTILINE))
    lexer = shlex.shlex(block, posix=True, punctuation_chars=";")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word == ";" or word == "curl" or word.split("=")[0] in variables:
            commands.append([])
        if word != ";":
            commands[-1].append(word)
    curls = []
    for words in (c for c in commands if c and c[0] == "curl"):
        url = next(w for w in words[1:] if w.startswith("localhost:8000"))
        headers, body = {}, None
        for flag, value in itertools.pairwise(words):
            for name, content in variables.items():
                value = value.replace(f"${name}", content)
            if flag == "-H":
                key, _, header = value.partition(":")
                headers[key] = header.strip()
            elif flag == "-d":
                body = json.loads(value)
        curls.append(Curl(url.removeprefix("localhost:8000"), headers, body))
    return curls


def test_the_tour_parses() -> None:
    curls = tour()
    assert curls[0].path == "/tokenize" and curls[0].body["prompt"] == "Hello world"
    assert {c.path for c in curls} >= {"/detokenize", "/metrics", "/v1/sessions/ep-1"}


def _decode(client: httpx.Client, ids: list[int]) -> str:
    return client.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def _choices_text(answer: Any) -> list[str]:
    return [c["text"] for c in answer["choices"]]


# One check per curl, in the tour's order: (the path it must be, what its answer must hold).
# Each gets the answer, the request and a client of the server.
Check = Callable[[Any, Curl, httpx.Client], None]


def _tokenize_text(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert _decode(client, answer["tokens"]) == curl.body["prompt"]
    assert "".join(answer["token_strs"]).replace("Ġ", " ") == curl.body["prompt"]
    # The detokenize line of the tour must name these ids (it named Qwen's).
    detokenize = next(c for c in tour() if c.path == "/detokenize")
    assert detokenize.body["tokens"] == answer["tokens"]


def _tokenize_chat(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert "<|im_start|>user\nHi<|im_end|>" in _decode(client, answer["tokens"])


def _detokenize(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert answer["prompt"] == "Hello world"


def _chat_render(answer: Any, curl: Curl, client: httpx.Client) -> None:
    prompt = _decode(client, answer["token_ids"])
    assert curl.body["messages"][0]["content"] in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert answer["sampling_params"]["max_tokens"] == 16


def _completion_render(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert [_decode(client, r["token_ids"]) for r in answer] == curl.body["prompt"]
    assert all(r["sampling_params"]["max_tokens"] == 8 for r in answer)


def _generate(answer: Any, curl: Curl, client: httpx.Client) -> None:
    # The prompt is the chat template's opening: <|im_start|>system\n.
    assert _decode(client, curl.body["token_ids"]) == "<|im_start|>system\n"
    (choice,) = answer["choices"]
    assert 1 <= len(choice["token_ids"]) <= 8
    if curl.body.get("output_mode") == "derender":
        assert choice["message"]["role"] == "assistant", choice
    else:
        assert all(len(entry["top_logprobs"]) == 2 for entry in choice["logprobs"]["content"])


def _status_only(answer: Any, curl: Curl, client: httpx.Client) -> None:
    pass  # the 200 is the answer (no request of that id runs; the server is up)


def _sglang_text(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert answer["text"] and answer["meta_info"]["completion_tokens"] <= 8
    assert len(answer["meta_info"]["output_token_logprobs"]) == len(answer["output_ids"])


def _sglang_batch(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert len(answer) == 4  # two prompts, n = 2 each
    assert all(1 <= len(item["output_ids"]) <= 4 for item in answer)


def _sglang_scoring(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert answer["output_ids"] == []
    ids = [entry[1] for entry in answer["meta_info"]["input_token_logprobs"]]
    assert ids == curl.body["input_ids"]


def _chat_derender(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert answer["choices"][0]["message"]["content"] == "The capital of France is Paris."


def _completion_derender(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert _choices_text(answer) == ["The capital"]


def _chat(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert answer["choices"][0]["message"]["content"]


def _completion(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert answer["usage"]["completion_tokens"] <= 5 and _choices_text(answer)[0]


def _chat_token_ids(answer: Any, curl: Curl, client: httpx.Client) -> None:
    choice = answer["choices"][0]
    assert _decode(client, answer["prompt_token_ids"]).endswith("<|im_start|>assistant\n")
    tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
    assert tokens == [f"token_id:{i}" for i in choice["token_ids"]]


def _echo(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert _choices_text(answer) == [curl.body["prompt"]]
    assert answer["usage"]["completion_tokens"] == 0


def _structured(answer: Any, curl: Curl, client: httpx.Client) -> None:
    content = json.loads(answer["choices"][0]["message"]["content"])
    assert content["city"] in ("Paris", "Lyon")


def _messages(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert answer["type"] == "message" and answer["content"]


def _responses(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert answer["object"] == "response" and answer["output"]


def _session(answer: Any, curl: Curl, client: httpx.Client) -> None:
    # The last turn is the tour's (the store may keep ep-1's turns of earlier runs).
    turn = answer["turns"][-1]
    segment = next(s for s in answer["segments"] if s["segment"] == turn["segment"])
    assert turn["sampled_ids"] and segment["token_ids"] == turn["prompt_ids"] + turn["sampled_ids"]
    assert segment["loss_mask"][-len(turn["sampled_ids"]) :] == [1] * len(turn["sampled_ids"])


def _models(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert [m["id"] for m in answer["data"]] == ["smollm2-135m-instruct"]


def _version(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert answer["version"]


def _metrics(answer: Any, curl: Curl, client: httpx.Client) -> None:
    assert "# TYPE" in answer


CHECKS: list[tuple[str, Check]] = [
    ("/tokenize", _tokenize_text),
    ("/tokenize", _tokenize_chat),
    ("/detokenize", _detokenize),
    ("/v1/chat/completions/render", _chat_render),
    ("/v1/completions/render", _completion_render),
    ("/inference/v1/generate", _generate),
    ("/abort_requests", _status_only),
    ("/generate", _sglang_text),
    ("/generate", _sglang_batch),
    ("/generate", _sglang_scoring),
    ("/inference/v1/generate", _generate),
    ("/v1/chat/completions/derender", _chat_derender),
    ("/v1/completions/derender", _completion_derender),
    ("/v1/chat/completions", _chat),
    ("/v1/completions", _completion),
    ("/v1/chat/completions", _chat_token_ids),
    ("/v1/completions", _echo),
    ("/v1/chat/completions", _structured),
    ("/v1/messages", _messages),
    ("/v1/responses", _responses),
    ("/v1/responses", _responses),
    ("/v1/sessions/ep-1", _session),
    ("/v1/models", _models),
    ("/health", _status_only),  # the 200 is the answer
    ("/version", _version),
    ("/metrics", _metrics),
]


@pytest.mark.timeout(600)
def test_every_curl_of_the_tour_answers_what_it_means(smollm2_server: Server) -> None:
    curls = tour()
    assert [c.path for c in curls] == [path for path, _ in CHECKS], "a tour curl has no check"
    with smollm2_server.client() as client:
        for curl, (_, check) in zip(curls, CHECKS, strict=True):
            if curl.body is None:
                response = client.get(curl.path, headers=curl.headers)
            else:
                response = client.post(curl.path, json=curl.body, headers=curl.headers)
            assert response.status_code == 200, f"{curl}: {response.text}"
            is_json = response.headers.get("content-type", "").startswith("application/json")
            check(response.json() if is_json else response.text, curl, client)
