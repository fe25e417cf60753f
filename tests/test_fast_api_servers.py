"""The job channel of ``--api-server-count``, in process: a frontend's app over a fake engine's
core (``rl_server``'s app, its own: these tests reload its weights), serving the channel on a
Unix socket, each app on its own event loop.

A frontend's answer must be the core's own, byte for byte but ids and times, and every state
the frontend meets (pause, weights, adapters, running ids) must be the core's.
``tests/test_api_servers.py`` runs the real processes over HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.conftest import API_KEY, RL_SERVER_ARGS, assert_error
from tests.fast_app import FastApp, serve_fast, without_ids
from tokenwire.api.app import create_app
from tokenwire.pipeline.core_channel import JobChannel
from tokenwire.pipeline.core_link import CoreLink
from tokenwire.settings import DEFAULT_MODEL, parse_serve_args

PROMPT = [504, 3458, 282, 4649, 314, 260]


@pytest.fixture(scope="module")
def core_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastApp]:
    yield from serve_fast(tmp_path_factory, RL_SERVER_ARGS, API_KEY)


@pytest.fixture
def rl_core(core_app: FastApp) -> Iterator[FastApp]:
    yield core_app
    core_app.settle()


@pytest.fixture(scope="module")
def frontend(core_app: FastApp, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = str(tmp_path_factory.mktemp("channel") / "core-jobs.sock")
    core = core_app.client
    assert core.portal is not None
    channel = JobChannel(core.app.state.pipeline)  # type: ignore[attr-defined]
    core.portal.call(channel.start, path)
    argv = [*RL_SERVER_ARGS, "--model", str(core_app.model_dir)]
    argv += ["--served-model-name", DEFAULT_MODEL, "--api-key", API_KEY]
    app = create_app(parse_serve_args(argv), core=CoreLink(path))
    try:
        with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            core_app.wait_until(lambda: client.get("/health").status_code == 200, 60)
            yield client
    finally:
        core.portal.call(channel.close)


def stream_events(client: TestClient, path: str, body: dict[str, Any]) -> list[Any]:
    """A stream's events, named or not, their data parsed and without ids and times."""
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        frames = response.read().decode().split("\n\n")
    events = []
    for frame in filter(None, frames):
        fields = dict(line.split(": ", 1) for line in frame.splitlines())
        data = fields["data"]
        events.append([fields.get("event"), data if data == "[DONE]" else json.loads(data)])
    assert events, "a stream of no events"
    return without_ids(events)


def test_answers_are_the_cores(rl_core: FastApp, frontend: TestClient) -> None:
    generate = {
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": 5, "n": 2, "logprobs": 2, "seed": 3},
    }
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True}
    sglang = {
        "input_ids": [PROMPT, PROMPT[:4]],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
    }
    anthropic = {"model": DEFAULT_MODEL, "max_tokens": 4, "messages": chat["messages"]}
    responses = {"model": DEFAULT_MODEL, "max_output_tokens": 4, "input": "hi", "top_logprobs": 2}
    for path, body in (
        ("/inference/v1/generate", generate),
        ("/v1/chat/completions", chat),
        ("/generate", sglang),
        ("/v1/messages", anthropic),
        ("/v1/responses", responses),
    ):
        here, there = frontend.post(path, json=body), rl_core.client.post(path, json=body)
        assert here.status_code == there.status_code == 200, here.text
        assert without_ids(here.json()) == without_ids(there.json())
        streamed = {**body, "stream": True}
        here_events = stream_events(frontend, path, streamed)
        assert here_events == stream_events(rl_core.client, path, streamed)
    # Continuing a stored answer needs a session, which the core owns: refused alike.
    for path, body in (
        (
            "/v1/messages",
            {**anthropic, "thread": {"type": "continue", "previous_message_id": "msg_1"}},
        ),
        ("/v1/responses", {**responses, "previous_response_id": "resp_1"}),
    ):
        here, there = frontend.post(path, json=body), rl_core.client.post(path, json=body)
        assert_error(here, 400, "X-Session-ID")
        assert here.json() == there.json()
    # atropos' VLLMServer body on SGLang's path
    vllm_server = {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 3, "logprobs": 1}
    here, there = (app.post("/generate", json=vllm_server) for app in (frontend, rl_core.client))
    assert here.status_code == there.status_code == 200, here.text
    assert here.json() == there.json()


def test_the_core_owns_the_gate_the_weights_and_the_adapters(
    rl_core: FastApp, frontend: TestClient
) -> None:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}
    assert rl_core.client.post("/pause").status_code == 200
    assert_error(frontend.post("/inference/v1/generate", json=body), 503, "paused")
    reload = {"weight_dir": str(rl_core.model_dir), "weight_version": "step-7"}
    assert rl_core.client.post("/update_weights", json=reload).status_code == 200
    assert rl_core.client.post("/resume").status_code == 200
    answer = frontend.post("/inference/v1/generate", json=body).json()
    assert answer["choices"][0]["weight_versions"][0]["version"] == "step-7"
    unknown = {**body, "model": "no-such-adapter"}
    assert_error(frontend.post("/inference/v1/generate", json=unknown), 404, "does not exist")
    for path, text in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": PROMPT})):
        for model, status in (("no-such-adapter", 404), (DEFAULT_MODEL, 200)):
            answer, expected = (
                app.post(path, json={**text, "model": model}) for app in (frontend, rl_core.client)
            )
            assert answer.status_code == expected.status_code == status, answer.text
            assert answer.json() == expected.json()
    assert rl_core.client.post("/update_weights", json={**reload, "weight_version": "default"})


def test_a_grammar_is_compiled_again_in_the_core(rl_core: FastApp, frontend: TestClient) -> None:
    """The engine gets a grammar compiled in its own process, from the frontend's text; and
    what the frontend decided for the engine (final_only) arrives with it."""
    body = {
        "prompt": "Yes or no?",
        "max_tokens": 8,
        "structured_outputs": {"choice": ["yes", "no"]},
    }
    assert frontend.post("/v1/completions", json=body).status_code == 200
    assert rl_core.client.post("/v1/completions", json=body).status_code == 200
    remote, local = rl_core.engine.calls[-2:]
    assert remote.sampling.grammar is not None and local.sampling.grammar is not None
    assert remote.sampling.grammar.text == local.sampling.grammar.text
    assert remote.sampling.grammar is not local.sampling.grammar  # two compilers' caches
    assert remote.final_only and local.final_only
    broken = {**body, "structured_outputs": {"regex": "("}}
    refused, refused_there = (
        client.post("/v1/completions", json=broken) for client in (frontend, rl_core.client)
    )
    assert refused.status_code == refused_there.status_code == 400
    assert refused.json() == refused_there.json()
