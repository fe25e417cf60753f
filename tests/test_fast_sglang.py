"""SGLang's /generate over the fake engine: meta_info, finish reason shapes, logprobs, text in,
cumulative streaming and bad input."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from tests.fake_engine import Reply, Step
from tests.fast_app import FastApp, serve_fast, sse_chunks
from tokenwire.pipeline.sglang import COALESCE

EOS = 2  # SmolLM2's <|im_end|>
PROMPT = [504, 3458, 314, 4649]


@pytest.fixture(scope="module")
def incremental(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastApp]:
    """SmolLM2's app with SGLang's --incremental-streaming-output."""
    yield from serve_fast(tmp_path_factory, ["--incremental-streaming-output"])


def stream_bytes(fast: FastApp, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """The size of a streamed /generate on the wire, and its chunks."""
    with fast.client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        raw = response.read()
    frames = raw.decode().split("\n\n")[:-2]
    return len(raw), [orjson.loads(frame.removeprefix("data: ")) for frame in frames]


def sglang(fast: FastApp, **body: Any) -> dict[str, Any]:
    response = fast.client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_meta_info_and_logprobs(fast_rl: FastApp) -> None:
    ids = fast_rl.tokenize(" Paris is the capital of France")[:5]
    steps = [Step(t, logprob=-0.5 - i, top=((t, -0.5 - i), (77, -4.0))) for i, t in enumerate(ids)]
    fast_rl.engine.script = lambda *_: Reply([*steps, EOS], num_cached_tokens=2)
    sampling = {"max_new_tokens": 5, "min_new_tokens": 1, "temperature": 0, "sampling_seed": 9}
    data = sglang(
        fast_rl,
        input_ids=PROMPT,
        sampling_params=sampling,
        return_logprob=True,
        top_logprobs_num=2,
        return_text_in_logprobs=True,
        rid="sg-1",
    )
    assert data["output_ids"] == ids
    assert data["text"] == " Paris is the capital of"
    meta = data["meta_info"]
    assert meta == {
        "id": "sg-1",
        "finish_reason": {"type": "length", "length": 5},
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 5,
        "cached_tokens": 2,
        "weight_version": "default",
        "weight_versions": [{"version": "default", "start": 0, "end": 5}],
        "output_token_logprobs": meta["output_token_logprobs"],
        "output_top_logprobs": [[[-0.5 - i, t, None], [-4.0, 77, None]] for i, t in enumerate(ids)],
    }
    assert [e[:2] for e in meta["output_token_logprobs"]] == [
        [-0.5 - i, t] for i, t in enumerate(ids)
    ]
    assert "".join(e[2] for e in meta["output_token_logprobs"]) == data["text"]
    (call,) = fast_rl.engine.calls
    assert (call.sampling.max_tokens, call.sampling.min_tokens) == (5, 1)
    assert (call.sampling.temperature, call.sampling.seed, call.sampling.logprobs) == (0, 9, 2)
    # Without return_logprob: no logprob fields, and the engine is asked for none.
    plain = sglang(fast_rl, input_ids=PROMPT, sampling_params={"max_new_tokens": 5})["meta_info"]
    assert "output_token_logprobs" not in plain and "output_top_logprobs" not in plain
    assert fast_rl.engine.calls[-1].sampling.logprobs is None


@pytest.mark.parametrize(
    ("sampling", "finish_reason", "text"),
    [
        ({}, {"type": "stop", "matched": EOS}, " Paris is big. It is old."),
        ({"stop_token_ids": [30]}, {"type": "stop", "matched": 30}, " Paris is big"),
        ({"stop": ["big"]}, {"type": "stop", "matched": "big"}, " Paris is "),
        (
            {"stop": "big", "no_stop_trim": True},
            {"type": "stop", "matched": "big"},
            " Paris is big",
        ),
        ({"max_new_tokens": 2}, {"type": "length", "length": 2}, " Paris is"),
    ],
)
def test_finish_reason_shapes(
    fast_smollm2: FastApp, sampling: dict[str, Any], finish_reason: dict[str, Any], text: str
) -> None:
    ids = fast_smollm2.tokenize(" Paris is big. It is old.")
    assert 30 in ids  # "."
    fast_smollm2.engine.script = lambda *_: [*ids, EOS]
    data = sglang(fast_smollm2, input_ids=PROMPT, sampling_params=sampling)
    assert data["meta_info"]["finish_reason"] == finish_reason
    assert data["text"] == text


def test_text_in_and_cumulative_streaming(fast_smollm2: FastApp) -> None:
    prompt = "The capital of France is"
    ids = fast_smollm2.tokenize(" Paris. It is big.")
    fast_smollm2.engine.script = lambda *_: [*ids, EOS]
    body = {"text": prompt, "sampling_params": {"stop": ["big"]}}
    whole = sglang(fast_smollm2, **body)
    assert fast_smollm2.engine.calls[0].prompt_token_ids == fast_smollm2.tokenize(prompt)
    assert whole["text"] == " Paris. It is "
    chunks = sse_chunks(fast_smollm2.client, "/generate", {**body, "stream": True})
    assert len(chunks) == len(whole["output_ids"])  # one per token the engine sent
    assert chunks[-1] == {**whole, "meta_info": chunks[-1]["meta_info"]}
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    for before, after in itertools.pairwise(chunks):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert after["text"].startswith(before["text"])
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


LONG = {
    "input_ids": PROMPT,
    "return_logprob": True,
    "top_logprobs_num": 20,
    "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
}


def test_cumulative_streams_stay_within_a_few_final_chunks(fast_smollm2: FastApp) -> None:
    """1,500 tokens with top-20 logprobs: one cumulative chunk per token was 797 MB on the wire
    (O(n^2)); a chunk now goes out once the output grew by 1/COALESCE, so the whole stream is
    a few times its last chunk, the first tokens still come one by one, and the last chunk is
    the whole answer."""
    whole = sglang(fast_smollm2, **LONG)
    size, chunks = stream_bytes(fast_smollm2, LONG)
    final = len(orjson.dumps(chunks[-1]))
    assert size < (COALESCE + 2) * final, (size, final)
    assert [len(c["output_ids"]) for c in chunks[:COALESCE]] == list(range(1, COALESCE + 1))
    assert chunks[-1]["output_ids"] == whole["output_ids"] and len(whole["output_ids"]) == 1500
    assert (
        chunks[-1]["meta_info"]["output_top_logprobs"] == whole["meta_info"]["output_top_logprobs"]
    )
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 1500}
    for before, after in itertools.pairwise(chunks):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]


def test_incremental_streams_send_deltas(incremental: FastApp) -> None:
    """SGLang's --incremental-streaming-output: each chunk carries only what is new (text,
    ids, logprob rows; input logprobs in the first); joined, they are the whole answer."""
    body = {**LONG, "logprob_start_len": 0}
    whole = sglang(incremental, **body)
    size, chunks = stream_bytes(incremental, body)
    assert len(chunks) == 1500  # one per token, as the engine sent them
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    meta = whole["meta_info"]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert [row for c in chunks for row in c["meta_info"][key]] == meta[key]
    assert chunks[0]["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"]
    assert all("input_token_logprobs" not in c["meta_info"] for c in chunks[1:])
    assert chunks[-1]["meta_info"]["finish_reason"] == meta["finish_reason"]
    assert size < 2 * len(orjson.dumps(whole)) + 1500 * 400  # each chunk's own meta_info


@pytest.mark.parametrize(
    "body",
    [
        {"sampling_params": {}},
        {"text": "a", "input_ids": [1]},
        {"text": ["a", 1]},
        {"text": []},
        {"input_ids": [[1], 2]},
        {"input_ids": [[1], [-1]]},
        {"input_ids": [-1]},
        {"input_ids": [10**9]},
        {"text": ["a", "b"], "rid": ["only-one"]},
        {"text": "a", "sampling_params": {"n": 1000}},
        {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2},
    ],
)
def test_sglang_generate_bad_input(fast_rl: FastApp, body: dict) -> None:
    assert fast_rl.client.post("/generate", json=body).status_code == 400
    assert fast_rl.engine.calls == []
    assert fast_rl.abort_all() == 0


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag"),
        ({"sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
        ({"sampling_params": {"logit_bias": {"5": 100}}}, "sampling_params.logit_bias"),
        ({"sampling_params": {"custom_params": {"a": 1}}}, "sampling_params.custom_params"),
        ({"image_data": "data:image/png;base64,AAAA"}, "image_data"),
        ({"video_data": ["v.mp4"]}, "video_data"),
        ({"audio_data": ["a.wav"]}, "audio_data"),
        ({"input_embeds": [[0.1, 0.2]]}, "input_embeds"),
        ({"lora_path": "adapter"}, "lora_path"),
        ({"lora_id": "adapter-1"}, "lora_id"),
        ({"custom_logit_processor": "serialized"}, "custom_logit_processor"),
        ({"session_params": {"id": "s"}}, "session_params"),
        ({"token_ids_logprob": [5, 6]}, "token_ids_logprob"),
        ({"return_hidden_states": True}, "return_hidden_states"),
        ({"return_routed_experts": True}, "return_routed_experts"),
    ],
)
def test_fields_that_change_the_output_and_are_not_served_are_a_400(
    fast_smollm2: FastApp, change: dict, param: str
) -> None:
    """SGLang fields tokenwire does not implement are refused by name (a 200 that ignored them
    would hand back an unconstrained, unbiased or text-only answer as if it were the one asked
    for); their "off" values pass, and an innocent request beside them is served."""
    refused = fast_smollm2.client.post("/generate", json={"input_ids": PROMPT, **change})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == param and param.split(".")[-1] in error["message"]
    assert fast_smollm2.engine.calls == []
    fast_smollm2.engine.script = lambda *_: [7, EOS]
    off = {"regex": None, "logit_bias": {}}
    innocent = sglang(fast_smollm2, input_ids=PROMPT, image_data=None, sampling_params=off)
    assert innocent["output_ids"] == [7, EOS]
    assert fast_smollm2.abort_all() == 0


def test_top_logprobs_list_the_sampled_token_first(fast_smollm2: FastApp) -> None:
    """vLLM's rule on every route: the sampled token, then the most likely others, k in all."""
    top = ((11, -0.1), (12, -1.0), (13, -2.0), (14, -2.5), (15, -3.0))
    fast_smollm2.engine.script = lambda *_: [Step(15, logprob=-3.0, rank=5, top=top), EOS]
    body = {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2}
    meta = sglang(fast_smollm2, **body)["meta_info"]
    assert meta["output_top_logprobs"][0] == [[-3.0, 15, None], [-0.1, 11, None]]
