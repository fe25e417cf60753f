"""``--max-logprobs -1`` on every dialect, over the fake engine: 300 alternatives per position
come back (more than fit in a byte, where the text layer used to stop), and a count over the
vocabulary is a 400 naming the field before any generation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.fake_engine import Reply, Step
from tests.fast_app import FastApp, serve_fast, sse_chunks

EOS = 2  # SmolLM2's <|im_end|>
PROMPT = [504, 3458, 314, 4649]
# "龘" in three byte tokens (E9, BE, 98): the alternatives at the second and third position
# follow pending bytes, so their texts are not the table's and are written rank by rank.
DRAGON = [180, 139, 242]
WIDTH = 300
SMOLLM2_VOCAB = 49152
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}


@pytest.fixture(scope="module")
def unlimited_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastApp]:
    """SmolLM2's app with ``--max-logprobs -1`` (the vocabulary size)."""
    yield from serve_fast(tmp_path_factory, ["--max-logprobs", "-1"])


@pytest.fixture
def wide(unlimited_app: FastApp) -> Iterator[FastApp]:
    """The app with an engine that reports ``WIDTH`` alternatives at each position."""
    unlimited_app.engine.script = lambda *_: Reply([*map(wide_step, DRAGON), wide_step(EOS)])
    yield unlimited_app
    unlimited_app.settle()


def top_ids(token_id: int) -> list[int]:
    """The sampled token, then ``WIDTH - 1`` others (ids with ASCII texts)."""
    return [token_id, *(i for i in range(1000, 1000 + WIDTH) if i != token_id)][:WIDTH]


def wide_step(token_id: int) -> Step:
    ids = top_ids(token_id)
    return Step(token_id, logprob=-0.5, top=tuple((t, -0.5 - j) for j, t in enumerate(ids)))


def post(fast: FastApp, path: str, body: dict[str, Any]) -> Any:
    response = fast.client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def pending_before(position: int) -> bytes:
    """The bytes of "龘" the output holds, unfinished, before ``position``."""
    return bytes([0xE9, 0xBE, 0x98][:position]) if position < len(DRAGON) else b""


def check_chat_content(content: list[dict[str, Any]]) -> None:
    """Each position lists ``WIDTH`` alternatives, each with the text it would add there."""
    assert [entry["token"] for entry in content] == ["", "", "龘", "<|im_end|>"]
    for position, entry in enumerate(content):
        top = entry["top_logprobs"]
        assert len(top) == WIDTH
        assert [alt["logprob"] for alt in top] == [-0.5 - j for j in range(WIDTH)]
        prior = pending_before(position)
        for alt in top[1:]:  # the others are ASCII: they end the pending character
            assert alt["token"] == (prior + bytes(alt["bytes"])).decode("utf-8", "replace")
        assert top[0]["token"] == entry["token"]


def test_chat_lists_300_alternatives(wide: FastApp) -> None:
    body = {**CHAT, "top_logprobs": WIDTH}
    data = post(wide, "/v1/chat/completions", body)
    assert data["choices"][0]["message"]["content"] == "龘"
    check_chat_content(data["choices"][0]["logprobs"]["content"])
    assert wide.engine.calls[-1].sampling.logprobs == WIDTH
    # Streamed, chunk by chunk with the decoder state carried between them.
    chunks = sse_chunks(wide.client, "/v1/chat/completions", {**body, "stream": True})
    content = [
        entry
        for chunk in chunks
        for choice in chunk["choices"]
        if choice.get("logprobs")
        for entry in choice["logprobs"]["content"]
    ]
    check_chat_content(content)


def test_completions_list_300_alternatives(wide: FastApp) -> None:
    data = post(wide, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "logprobs": WIDTH})
    logprobs = data["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["", "", "龘", "<|im_end|>"]
    for position, row in enumerate(logprobs["top_logprobs"]):
        assert len(row) == WIDTH  # the texts differ: none share a key
        assert row[logprobs["tokens"][position]] == -0.5
        if position in (1, 2):  # after a pending byte: U+FFFD, then the ASCII alternative
            assert sum(text.startswith("\ufffd") for text in row) == WIDTH - 1


def test_generate_lists_300_alternatives(wide: FastApp) -> None:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "logprobs": WIDTH}}
    data = post(wide, "/inference/v1/generate", body)
    content = data["choices"][0]["logprobs"]["content"]
    assert [entry["token_id"] for entry in content] == [*DRAGON, EOS]
    for entry in content:
        assert [alt["token_id"] for alt in entry["top_logprobs"]] == top_ids(entry["token_id"])
    # -1 asks for the limit, the vocabulary: every alternative the engine reported.
    body["sampling_params"]["logprobs"] = -1
    data = post(wide, "/inference/v1/generate", body)
    assert wide.engine.calls[-1].sampling.logprobs == SMOLLM2_VOCAB
    assert all(len(e["top_logprobs"]) == WIDTH for e in data["choices"][0]["logprobs"]["content"])


def test_sglang_lists_300_alternatives(wide: FastApp) -> None:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 8},
        "return_logprob": True,
        "top_logprobs_num": WIDTH,
        "return_text_in_logprobs": True,
    }
    meta = post(wide, "/generate", body)["meta_info"]
    assert [row[1] for row in meta["output_token_logprobs"]] == [*DRAGON, EOS]
    for token_id, row in zip([*DRAGON, EOS], meta["output_top_logprobs"], strict=True):
        assert [alt[1] for alt in row] == top_ids(token_id)


OVER = SMOLLM2_VOCAB + 1
REFUSED = [
    ("/v1/chat/completions", {**CHAT, "top_logprobs": OVER}, "top_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": OVER}, "logprobs"),
    (
        "/inference/v1/generate",
        {"token_ids": PROMPT, "sampling_params": {"logprobs": OVER}},
        "sampling_params.logprobs",
    ),
    (
        "/generate",
        {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": OVER},
        "top_logprobs_num",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED, ids=[r[2] for r in REFUSED])
def test_more_than_the_vocabulary_is_a_400_before_generation(
    wide: FastApp, path: str, body: dict[str, Any], param: str
) -> None:
    response = wide.client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert f"max allowed: {SMOLLM2_VOCAB}" in error["message"]
    assert not wide.engine.calls
