"""/inference/v1/generate and the abort routes over the fake engine: the generation job, stop
handling, the logprob, usage and version JSON, streaming, n > 1, aborts and bad input."""

from __future__ import annotations

import concurrent.futures
import gc
import threading
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.conftest import assert_error
from tests.fake_engine import Gate, Reply, Step
from tests.fast_app import FastApp, sse_chunks
from tokenwire.engine.base import TokenLogprob

EOS = 2  # SmolLM2's <|im_end|>
PROMPT = [504, 3458, 314, 4649]  # no eos among them: the default script cycles them


def generate(client: TestClient, token_ids: list[int], **sampling: Any) -> dict[str, Any]:
    response = client.post(
        "/inference/v1/generate", json={"token_ids": token_ids, "sampling_params": sampling}
    )
    assert response.status_code == 200, response.text
    return response.json()


def nothing_runs(fast: FastApp) -> None:
    """No job in the registry (an abort-all finds none) and no engine request left."""
    assert fast.abort_all() == 0
    assert not fast.engine.live


def test_a_choice_reports_tokens_reasons_versions_and_usage(fast_smollm2: FastApp) -> None:
    answer = fast_smollm2.tokenize(" Paris is the capital.")
    fast_smollm2.engine.script = lambda *_: [*answer, EOS]
    data = generate(fast_smollm2.client, PROMPT, max_tokens=50)
    assert data["model"] == "smollm2-135m-instruct"
    assert data["choices"] == [
        {
            "index": 0,
            "token_ids": [*answer, EOS],
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,
            "weight_versions": [{"version": "default", "start": 0, "end": len(answer) + 1}],
        }
    ]
    assert data["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(answer) + 1,
        "total_tokens": len(PROMPT) + len(answer) + 1,
    }
    assert data["prompt_logprobs"] is None
    (call,) = fast_smollm2.engine.calls
    assert call.prompt_token_ids == PROMPT and call.sampling.max_tokens == 50


@pytest.mark.parametrize(
    ("script", "sampling", "token_ids", "finish_reason", "stop_reason"),
    [
        ([5, 6, EOS, 7], {}, [5, 6, EOS], "stop", None),
        ([5, 6, 7, 8], {"stop_token_ids": [7]}, [5, 6, 7], "stop", 7),
        ([5, 6, 7, 8], {"max_tokens": 3}, [5, 6, 7], "length", None),
        ([5, EOS, 6, 7], {"ignore_eos": True, "max_tokens": 3}, [5, EOS, 6], "length", None),
        ([EOS, 5, EOS, 6], {"min_tokens": 2}, [EOS, 5, EOS], "stop", None),
        ([EOS, 7, 5], {"stop_token_ids": [EOS, 7], "ignore_eos": True}, [EOS], "stop", EOS),
    ],
)
def test_finish_and_stop_reasons(
    fast_smollm2: FastApp,
    script: list[int],
    sampling: dict[str, Any],
    token_ids: list[int],
    finish_reason: str,
    stop_reason: int | None,
) -> None:
    """The job passes the stop controls to the engine and reports why the choice ended."""
    fast_smollm2.engine.script = lambda *_: script
    (choice,) = generate(fast_smollm2.client, PROMPT, **sampling)["choices"]
    assert choice["token_ids"] == token_ids
    assert (choice["finish_reason"], choice["stop_reason"]) == (finish_reason, stop_reason)


def test_omitted_max_tokens_is_what_fits(fast_smollm2: FastApp) -> None:
    fast_smollm2.engine.script = lambda *_: [5, EOS]
    generate(fast_smollm2.client, PROMPT)
    (call,) = fast_smollm2.engine.calls
    assert call.sampling.max_tokens == fast_smollm2.engine.max_model_len - len(PROMPT)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ends_the_choice_at_the_token_completing_it(
    fast_smollm2: FastApp, include: bool
) -> None:
    """The ids keep the token that completes the stop string, even when the engine sent it
    among later tokens in one output; ``include_stop_str_in_output`` changes text, not ids."""
    ids = fast_smollm2.tokenize("The capital of France is Paris. It is big.")
    paris = ids.index(fast_smollm2.tokenize(" Paris")[0])
    fast_smollm2.engine.script = lambda *_: [ids[:paris], ids[paris:], [EOS]]
    body = {"stop": ["Paris"], "include_stop_str_in_output": include, "logprobs": 0}
    (choice,) = generate(fast_smollm2.client, PROMPT, **body)["choices"]
    assert choice["token_ids"] == ids[: paris + 1]
    assert len(choice["logprobs"]["content"]) == paris + 1
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "Paris")
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": paris + 1}]


def test_logprobs_json_puts_the_sampled_token_first(fast_smollm2: FastApp) -> None:
    steps = [
        Step(11, logprob=-0.25, rank=1, top=((11, -0.25), (19, -1.5), (18, -2.0))),
        Step(12, logprob=-3.0, rank=3, top=((15, -0.5), (16, -1.0), (12, -3.0))),
        Step(EOS, logprob=float("-inf"), rank=7, top=((15, -0.1), (16, -2.5))),
    ]
    fast_smollm2.engine.script = lambda *_: steps

    def entry(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        placeholder = f"token_id:{token_id}"
        return {"token": placeholder, "token_id": token_id, "logprob": logprob, "rank": rank}

    def content(k: int) -> list[dict[str, Any]]:
        (choice,) = generate(fast_smollm2.client, PROMPT, logprobs=k)["choices"]
        for position in choice["logprobs"]["content"]:
            assert position.pop("bytes") is None
            assert all(top.pop("bytes") is None for top in position["top_logprobs"])
        return choice["logprobs"]["content"]

    assert content(2) == [
        {**entry(11, -0.25, 1), "top_logprobs": [entry(11, -0.25, 1), entry(19, -1.5, 2)]},
        {**entry(12, -3.0, 3), "top_logprobs": [entry(12, -3.0, 3), entry(15, -0.5, 1)]},
        {**entry(EOS, -9999.0, 7), "top_logprobs": [entry(EOS, -9999.0, 7), entry(15, -0.1, 1)]},
    ]
    # k = 0: the sampled token alone.
    assert [[top["token_id"] for top in e["top_logprobs"]] for e in content(0)] == [
        [11],
        [12],
        [EOS],
    ]


def test_prompt_logprobs_json(fast_smollm2: FastApp) -> None:
    scripted = [
        None,
        TokenLogprob(PROMPT[1], -1.5, 2, ((77, -0.5), (PROMPT[1], -1.5))),
        TokenLogprob(PROMPT[2], -0.1, 1, ((PROMPT[2], -0.1), (78, -3.0))),
        TokenLogprob(PROMPT[3], float("nan"), 1, ()),
    ]
    fast_smollm2.engine.script = lambda *_: Reply([5, EOS], prompt_logprobs=scripted)
    data = generate(fast_smollm2.client, PROMPT, prompt_logprobs=1)

    def value(logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": None}

    expected = [
        None,
        {str(PROMPT[1]): value(-1.5, 2), "77": value(-0.5, 1)},
        {str(PROMPT[2]): value(-0.1, 1)},
        {str(PROMPT[3]): value(-9999.0, 1)},
    ]
    assert data["prompt_logprobs"] == expected
    body = {"token_ids": PROMPT, "sampling_params": {"prompt_logprobs": 1}, "stream": True}
    chunks = sse_chunks(fast_smollm2.client, "/inference/v1/generate", body)
    assert chunks[0]["prompt_logprobs"] == expected
    assert all("prompt_logprobs" not in chunk for chunk in chunks[1:])


def test_n_choices_get_seed_plus_index_and_their_own_outputs(fast_smollm2: FastApp) -> None:
    fast_smollm2.engine.script = lambda _, __, sampling: [100 + sampling.seed] * 2 + [EOS]
    data = generate(fast_smollm2.client, PROMPT, n=3, seed=11)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in data["choices"]] == [
        [111, 111, EOS],
        [112, 112, EOS],
        [113, 113, EOS],
    ]
    assert data["usage"]["completion_tokens"] == 9
    assert data["usage"]["prompt_tokens"] == len(PROMPT)  # the prompt counts once
    assert all(c["weight_versions"][0]["end"] == 3 for c in data["choices"])


def test_usage_reports_the_engines_cached_prompt_tokens(fast_smollm2: FastApp) -> None:
    fast_smollm2.engine.script = lambda *_: Reply([5, EOS], num_cached_tokens=3)
    usage = generate(fast_smollm2.client, PROMPT)["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 3}
    body = {"token_ids": PROMPT, "sampling_params": {}, "stream": True}
    chunks = sse_chunks(
        fast_smollm2.client, "/inference/v1/generate", {**body, "stream_options": {}}
    )
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}


@pytest.mark.parametrize(
    ("path", "body", "salts"),
    [
        ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"n": 2}}, ["s", "s"]),
        ("/v1/completions", {"prompt": ["a", "b"]}, ["s", "s"]),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, ["s"]),
        ("/generate", {"input_ids": [PROMPT, PROMPT]}, ["s", "s"]),
        ("/generate", {"input_ids": [PROMPT, PROMPT], "cache_salt": ["s", "t"]}, ["s", "t"]),
    ],
)
def test_cache_salt_reaches_the_engine_on_every_route(
    fast_smollm2: FastApp, path: str, body: dict[str, Any], salts: list[str]
) -> None:
    """The salt the prefix cache partitions by (vLLM's): every choice of every prompt has it."""
    fast_smollm2.engine.script = lambda *_: [5, EOS]
    response = fast_smollm2.client.post(path, json={"cache_salt": "s", "max_tokens": 2, **body})
    assert response.status_code == 200, response.text
    assert [call.cache_salt for call in fast_smollm2.engine.calls] == salts
    fast_smollm2.engine.calls.clear()
    generate(fast_smollm2.client, PROMPT)
    assert [call.cache_salt for call in fast_smollm2.engine.calls] == [None]


CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("path", "body", "final_only"),
    [
        ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"n": 2}}, True),
        (
            "/inference/v1/generate",
            {"token_ids": PROMPT, "sampling_params": {}, "stream": True},
            False,
        ),
        ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"stop": "x"}}, False),
        ("/v1/chat/completions", {"messages": CHAT}, True),
        ("/v1/chat/completions", {"messages": CHAT, "stream": True}, False),
        ("/v1/chat/completions", {"messages": CHAT, "stop": ["x"]}, False),
        ("/generate", {"input_ids": [PROMPT, PROMPT]}, True),
        ("/generate", {"input_ids": PROMPT, "stream": True}, False),
    ],
)
def test_only_a_choice_read_at_its_end_asks_the_engine_for_its_end_only(
    fast_smollm2: FastApp, path: str, body: dict[str, Any], final_only: bool
) -> None:
    """A non-streamed choice without stop strings lets the engine hold its outputs to the end
    (vLLM's FINAL_ONLY: no per-step cost here); a streamed one, or one whose stop strings are
    found above the engine, needs every step."""
    fast_smollm2.engine.script = lambda *_: [5, EOS]
    response = fast_smollm2.client.post(path, json={"max_tokens": 2, **body})
    assert response.status_code == 200, response.text
    calls = fast_smollm2.engine.calls
    assert calls and all(call.final_only == final_only for call in calls)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {}, "cache_salt": ""}),
        ("/v1/completions", {"prompt": "a", "cache_salt": ""}),
        ("/generate", {"input_ids": PROMPT, "cache_salt": [""]}),
        ("/generate", {"input_ids": [PROMPT, PROMPT], "cache_salt": ["s"]}),
    ],
)
def test_a_bad_cache_salt_is_a_400(fast_smollm2: FastApp, path: str, body: dict) -> None:
    assert_error(fast_smollm2.client.post(path, json=body), 400, "cache_salt")
    assert not fast_smollm2.engine.calls


def test_streaming_chunks_usage_and_versions(fast_smollm2: FastApp) -> None:
    """One chunk per engine output (several tokens in one stay together), the finish reason
    and versions only on the last, usage per chunk when continuous, then the usage chunk."""
    fast_smollm2.engine.script = lambda *_: [[5, 6], [7], [8, EOS]]
    body = {
        "token_ids": PROMPT,
        "request_id": "stream-1",
        "sampling_params": {"logprobs": 1},
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = sse_chunks(fast_smollm2.client, "/inference/v1/generate", body)
    *deltas, usage_chunk = chunks
    assert all(c["request_id"] == "stream-1" for c in chunks)
    assert [c["choices"][0]["token_ids"] for c in deltas] == [[5, 6], [7], [8, EOS]]
    assert [len(c["choices"][0]["logprobs"]["content"]) for c in deltas] == [2, 1, 2]
    assert [c["choices"][0]["finish_reason"] for c in deltas] == [None, None, "stop"]
    assert [c["usage"]["completion_tokens"] for c in deltas] == [2, 3, 5]
    assert ["weight_versions" in c["choices"][0] for c in deltas] == [False, False, True]
    assert deltas[-1]["choices"][0]["weight_versions"] == [
        {"version": "default", "start": 0, "end": 5}
    ]
    assert usage_chunk == {
        "request_id": "stream-1",
        "choices": [],
        "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9},
    }
    whole = generate(fast_smollm2.client, PROMPT, logprobs=1)["choices"][0]
    assert [t for c in deltas for t in c["choices"][0]["token_ids"]] == whole["token_ids"]
    # Without stream_options: no usage anywhere.
    plain = sse_chunks(
        fast_smollm2.client, "/inference/v1/generate", {**body, "stream_options": None}
    )
    assert all("usage" not in c and c["choices"] for c in plain)


def test_streamed_choices_interleave_and_end_on_their_own(fast_smollm2: FastApp) -> None:
    """Choice 1 runs to its end while choice 0 waits at a gate: its chunks come first."""
    gate = Gate()
    scripts = {7: [5, Step(6, gate=gate), EOS], 8: [9, 9, 9, EOS]}
    fast_smollm2.engine.script = lambda _, __, sampling: scripts[sampling.seed]
    body = {"token_ids": PROMPT, "sampling_params": {"n": 2, "seed": 7}, "stream": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reading = pool.submit(sse_chunks, fast_smollm2.client, "/inference/v1/generate", body)
        gate.wait_reached()
        fast_smollm2.wait_until(lambda: len(fast_smollm2.engine.live) == 1)  # choice 1 ended
        gate.open()
        chunks = reading.result(timeout=10)
    order = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks]
    assert order.index((1, "stop")) < order.index((0, "stop"))
    for index, tokens in ((0, [5, 6, EOS]), (1, [9, 9, 9, EOS])):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert [t for c in mine for t in c["token_ids"]] == tokens
        assert mine[-1]["weight_versions"] == [
            {"version": "default", "start": 0, "end": len(tokens)}
        ]


def test_abort_by_id_keeps_partial_tokens(fast_smollm2: FastApp) -> None:
    gate = Gate()
    fast_smollm2.engine.script = lambda *_: [5, 6, 7, Step(8, gate=gate), EOS]
    body = {"token_ids": PROMPT, "request_id": "abort-me", "sampling_params": {}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(fast_smollm2.client.post, "/inference/v1/generate", json=body)
        gate.wait_reached()
        aborted = fast_smollm2.client.post(
            "/abort_requests", json={"request_ids": ["abort-me", "unknown"]}
        )
        assert aborted.json() == {"status": "aborted", "aborted": 1}
        (choice,) = answer.result(timeout=10).json()["choices"]
    assert choice["token_ids"] == [5, 6, 7]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("abort", None)
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]
    nothing_runs(fast_smollm2)


def test_abort_ends_a_stream_with_its_tokens_so_far(fast_smollm2: FastApp) -> None:
    gate = Gate()
    fast_smollm2.engine.script = lambda *_: [5, 6, Step(8, gate=gate), EOS]
    body = {"token_ids": PROMPT, "request_id": "s", "sampling_params": {"n": 2}, "stream": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reading = pool.submit(sse_chunks, fast_smollm2.client, "/inference/v1/generate", body)
        gate.wait_reached()
        # vLLM's other shape: no answer body, and an empty list aborts nothing.
        assert fast_smollm2.client.post("/inference/v1/abort_requests", json={"request_ids": []})
        assert len(fast_smollm2.engine.live) == 2
        response = fast_smollm2.client.post(
            "/inference/v1/abort_requests", json={"request_ids": ["s"]}
        )
        assert response.status_code == 200
        chunks = reading.result(timeout=10)
    finals = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finals) == [0, 1]
    assert all(f["finish_reason"] == "abort" and f["token_ids"] == [] for f in finals)
    assert all(f["weight_versions"][-1]["end"] == 2 for f in finals)
    nothing_runs(fast_smollm2)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_ends_its_engine_requests(
    fast_smollm2: FastApp, stream: bool
) -> None:
    gate = Gate()
    fast_smollm2.engine.script = lambda *_: [5, 6, Step(8, gate=gate), EOS]
    body = {"token_ids": PROMPT, "sampling_params": {"n": 2}, "stream": stream}
    disconnect = threading.Event()
    sent = fast_smollm2.post_then_disconnect("/inference/v1/generate", body, disconnect)
    gate.wait_reached()
    assert len(fast_smollm2.engine.live) == 2
    disconnect.set()
    messages = sent.result(timeout=10)
    assert messages[0]["status"] == (200 if stream else 499)
    fast_smollm2.wait_until(lambda: not fast_smollm2.engine.live)
    assert all(call.finish_reason is None for call in fast_smollm2.engine.calls)
    metrics = fast_smollm2.client.get("/metrics").text
    assert "tokenwire_engine_running_requests 0.0" in metrics.splitlines()
    nothing_runs(fast_smollm2)


def test_a_stream_left_while_it_waits_to_send_ends_its_engine_requests(
    fast_smollm2: FastApp,
) -> None:
    """TestClient sends without a buffer: a reader that stops holds the app inside send(), as
    a full socket buffer does; closing the response then cancels the app there."""
    fast_smollm2.engine.script = lambda *_: [5, 6, Step(8, gate=Gate()), EOS]
    body = {"token_ids": PROMPT, "sampling_params": {}, "stream": True}
    gc.disable()  # the slot must be freed by the cancellation, not by a collection
    try:
        with fast_smollm2.client.stream("POST", "/inference/v1/generate", json=body) as response:
            next(line for line in response.iter_lines() if line.startswith("data: "))
        fast_smollm2.wait_until(lambda: not fast_smollm2.engine.live, timeout=1)
    finally:
        gc.enable()
        gc.collect()  # finalizes the stream left behind, which ends its job
        fast_smollm2.wait_until(lambda: fast_smollm2.abort_all() == 0)


def test_a_running_request_id_is_refused(fast_smollm2: FastApp) -> None:
    gate = Gate()
    fast_smollm2.engine.script = lambda *_: [5, Step(6, gate=gate), EOS]
    body = {"token_ids": PROMPT, "request_id": "dup", "sampling_params": {}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(fast_smollm2.client.post, "/inference/v1/generate", json=body)
        gate.wait_reached()
        again = fast_smollm2.client.post("/inference/v1/generate", json=body)
        assert_error(again, 400, "already running")
        gate.open()
        assert first.result(timeout=10).json()["choices"][0]["token_ids"] == [5, 6, EOS]
    nothing_runs(fast_smollm2)


def test_request_ids_x_and_x_dash_1_run_at_once(fast_smollm2: FastApp) -> None:
    gate = Gate()
    other = [9, 9, 9]
    scripts = {tuple(PROMPT): [5, Step(6, gate=gate), EOS], tuple(other): [7, EOS]}
    fast_smollm2.engine.script = lambda _, prompt, __: scripts[tuple(prompt)]
    x = {"token_ids": PROMPT, "request_id": "x", "sampling_params": {"n": 2}}
    x_1 = {"token_ids": other, "request_id": "x-1", "sampling_params": {}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(fast_smollm2.client.post, "/inference/v1/generate", json=x)
        try:
            gate.wait_reached()
            second = fast_smollm2.client.post("/inference/v1/generate", json=x_1)
        finally:
            gate.open()
        assert second.status_code == 200, second.text
        assert second.json()["choices"][0]["token_ids"] == [7, EOS]
        answer = first.result(timeout=10).json()
        assert [c["token_ids"] for c in answer["choices"]] == [[5, 6, EOS]] * 2


def test_request_id_header_wins(fast_smollm2: FastApp) -> None:
    fast_smollm2.engine.script = lambda *_: [5, EOS]
    response = fast_smollm2.client.post(
        "/inference/v1/generate",
        json={"token_ids": PROMPT, "request_id": "from-body", "sampling_params": {}},
        headers={"X-Request-Id": "from-header"},
    )
    assert response.json()["request_id"] == "from-header"
    assert response.headers["x-request-id"] == "from-header"


def test_compatibility_fields_are_accepted(fast_smollm2: FastApp) -> None:
    sampling = {
        "max_tokens": 3,
        "temperature": 0,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "include_stop_str_in_output": True,
        "routed_experts_prompt_start": 0,
        "detokenize": False,
        "seed": -1,
    }
    response = fast_smollm2.client.post(
        "/inference/v1/generate",
        json={"token_ids": PROMPT, "sampling_params": sampling, "cache_salt": "s", "priority": 0},
        headers={"X-Session-ID": "abc", "X-data-parallel-rank": "0"},
    )
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["token_ids"]) == 3


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"token_ids": [1, -2], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [49152], "sampling_params": {}}, "out of vocabulary"),
        ({"token_ids": [], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [1] * 9000, "sampling_params": {}}, "maximum context length"),
        (
            {"token_ids": [1] * 10, "sampling_params": {"max_tokens": 9000}},
            "maximum context length",
        ),
        ({"token_ids": [1], "sampling_params": {"stop": ["x"], "detokenize": False}}, "detokenize"),
        ({"token_ids": [1], "sampling_params": {"n": 99}}, "n must be at most"),
        ({"token_ids": [1], "sampling_params": {"n": 0}}, "n must be at least 1"),
        ({"token_ids": [1], "sampling_params": {"bogus_field": 1}}, "bogus_field"),
        ({"token_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"token_ids": [1], "sampling_params": {"logprobs": 21}}, "max allowed: 20"),
        ({"token_ids": [1], "sampling_params": {"prompt_logprobs": 50}}, "max allowed: 20"),
        ({"token_ids": [1], "sampling_params": {"logit_bias": {"1": 5}}}, "logit_bias"),
        ({"token_ids": [1]}, "sampling_params"),
        ({"token_ids": [1], "sampling_params": {}, "model": "nope"}, "does not exist"),
        (
            {
                "token_ids": [1],
                "sampling_params": {},
                "content_parts": [{"type": "image_url", "url": "http://x/a.png"}],
                "features": {"mm_hashes": {}, "mm_placeholders": {}},
            },
            "content_parts and features are mutually exclusive",
        ),
        (
            {
                "token_ids": [1],
                "sampling_params": {},
                "content_parts": [{"type": "pdf_url", "url": "http://x/a.pdf"}],
            },
            "content_parts",
        ),
    ],
)
def test_generate_bad_input(fast_smollm2: FastApp, body: dict, message: str) -> None:
    """Refused before the engine sees anything, and nothing is left running."""
    response = fast_smollm2.client.post("/inference/v1/generate", json=body)
    status = 404 if message == "does not exist" else 400
    assert_error(response, status, message)
    assert fast_smollm2.engine.calls == []
    nothing_runs(fast_smollm2)
