"""Schemathesis against the running server's own OpenAPI document.

For every operation, schema-valid (positive) and schema-invalid (negative) requests go over HTTP
to the real servers; every answer must be no 5xx, a documented status, a documented content type,
and a body (each SSE event, too) that matches the documented schema. Bounded for the suite;
``make fuzz`` runs many more examples with fresh randomness (``TOKENWIRE_FUZZ_EXAMPLES``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import Server

# The suite's run is small and the same every time; `make fuzz` sets a count and draws afresh.
EXAMPLES = int(os.environ.get("TOKENWIRE_FUZZ_EXAMPLES", "0")) or None
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
# Every operation of a server without --enable-rl-control (those routes pause and reload the
# server; tests/test_rl_control.py covers them). A route missing here fails the listing test.
OPERATIONS = [
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/version"),
    ("GET", "/metrics"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/chat/completions/render"),
    ("POST", "/v1/completions/render"),
    ("POST", "/v1/chat/completions/extend"),
    ("POST", "/inference/v1/generate"),
    ("POST", "/abort_requests"),
    ("POST", "/inference/v1/abort_requests"),
    ("POST", "/v1/chat/completions/derender"),
    ("POST", "/v1/completions/derender"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/generate"),
    ("POST", "/abort_request"),
    ("GET", "/model_info"),
    ("GET", "/get_load"),
    ("GET", "/load"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/messages/render"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/responses/render"),
    ("GET", "/v1/sessions"),
    ("GET", "/v1/sessions/{session_id}"),
    ("GET", "/v1/sessions/{session_id}/view"),
    ("DELETE", "/v1/sessions/{session_id}"),
]
# Negative cases need an input to break: only the POST routes take one.
CASES = [(method, path, GenerationMode.POSITIVE) for method, path in OPERATIONS] + [
    (method, path, GenerationMode.NEGATIVE) for method, path in OPERATIONS if method == "POST"
]
CASE_IDS = [f"{method} {path} {mode.value}" for method, path, mode in CASES]
OPERATION_IDS = [f"{method} {path}" for method, path in OPERATIONS]
# Caps so that a generated request finishes quickly: output length and logprob widths (an
# absent output length means "up to the context", minutes of decoding).
CAPS = {
    "max_tokens": 3,
    "max_completion_tokens": 3,
    "max_new_tokens": 3,
    "logprobs": 3,
    "top_logprobs": 3,
    "prompt_logprobs": 3,
    "top_logprobs_num": 3,
    "max_output_tokens": 3,
}
# Where each generating route takes its output length: (the object holding it, its name).
LENGTH_FIELD = {
    "/inference/v1/generate": ("sampling_params", "max_tokens"),
    "/generate": ("sampling_params", "max_new_tokens"),
    "/v1/chat/completions": (None, "max_tokens"),
    "/v1/completions": (None, "max_tokens"),
    "/v1/responses": (None, "max_output_tokens"),
}

# Requests that succeed, so that every 200 form (JSON and each SSE stream) is checked against
# its schema whatever the generator draws; they run first, in positive mode.
CHAT = [{"role": "user", "content": "Hi"}]
GENERATED = {"request_id": "r1", "choices": [{"index": 0, "token_ids": [504, 3575]}]}
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
STREAMED = {"stream": True, "stream_options": {"include_usage": True}}
GOOD_BODIES: dict[str, list[dict[str, Any]]] = {
    "/tokenize": [{"prompt": "Hello world", "return_token_strs": True}, {"messages": CHAT}],
    "/detokenize": [{"tokens": [9707, 1879]}],
    "/v1/chat/completions/render": [{"messages": CHAT, "max_tokens": 2, "seed": 1}],
    "/v1/completions/render": [{"prompt": ["Hello", "Bonjour"], "max_tokens": 2}],
    "/v1/chat/completions/extend": [
        {
            "previous_token_ids": [1, 9690, 198, 4093, 2, 198, 1, 520, 9531, 198, 19556, 2],
            "previous_messages": [*CHAT, {"role": "assistant", "content": "Hello!"}],
            "messages": [{"role": "user", "content": "Tell me a joke."}],
            "max_tokens": 2,
        }
    ],
    "/inference/v1/generate": [
        {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "logprobs": 2, "n": 2}},
        {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "prompt_logprobs": 1}},
        {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "logprobs": 1}, **STREAMED},
    ],
    "/abort_requests": [{"request_ids": ["r1"]}],
    "/inference/v1/abort_requests": [{"request_ids": ["r1"]}],
    "/v1/chat/completions/derender": [
        {"generate_response": {**GENERATED, "usage": USAGE}, "prompt_tokens": 3},
        {"stream": True, "generate_chunk": {**GENERATED, "usage": USAGE}},
    ],
    "/v1/completions/derender": [{"generate_responses": [GENERATED]}],
    "/v1/chat/completions": [
        {"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 2},
        {"messages": CHAT, "max_tokens": 2, **STREAMED},
    ],
    "/v1/completions": [
        {"prompt": "Hello", "max_tokens": 2, "logprobs": 2},
        {"prompt": ["Hello", "Bonjour"], "max_tokens": 2, **STREAMED},
    ],
    "/generate": [
        {"text": "Hello", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True},
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "stream": True},
    ],
    "/abort_request": [{"rid": "r1"}],
    "/v1/messages": [
        {"messages": CHAT, "max_tokens": 2, "system": "Be brief."},
        {"messages": CHAT, "max_tokens": 2, "stream": True},
    ],
    "/v1/messages/count_tokens": [{"messages": CHAT}],
    "/v1/messages/render": [{"messages": CHAT, "max_tokens": 2}],
    "/v1/responses": [
        {"input": "Hi", "max_output_tokens": 2, "instructions": "Be brief."},
        {"input": CHAT, "max_output_tokens": 2, "stream": True},
    ],
    "/v1/responses/render": [{"input": "Hi"}],
}


def load_schema(server: Server) -> schemathesis.BaseSchema:
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=headers, timeout=30)


@pytest.fixture(scope="module")
def qwen3_schema(qwen3_server: Server) -> schemathesis.BaseSchema:
    return load_schema(qwen3_server)


@pytest.fixture(scope="module")
def smollm2_schema(smollm2_server: Server) -> schemathesis.BaseSchema:
    return load_schema(smollm2_server)


def bound(path: str, body: Any, served_name: str, name_it: bool) -> None:
    """Cap what makes a request slow, in place; optionally name the served model so that more
    requests get past the model check (unknown names are 404s, fuzzed all the same)."""
    if not isinstance(body, dict):
        return
    for holder in (body, body.get("sampling_params")):
        if isinstance(holder, dict):
            for key, cap in CAPS.items():
                value = holder.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                    holder[key] = cap
    if path in LENGTH_FIELD:
        parent, key = LENGTH_FIELD[path]
        holder = body if parent is None else body.setdefault(parent, {})
        if isinstance(holder, dict) and holder.get(key) is None:
            holder[key] = CAPS[key]
    if name_it and isinstance(body.get("model"), str):
        body["model"] = served_name


def fuzz(
    server: Server,
    schema: schemathesis.BaseSchema,
    method: str,
    path: str,
    mode: GenerationMode,
    examples: int,
) -> None:
    operation = schema[path][method]
    with server.client() as client:
        served_name = client.get("/v1/models").json()["data"][0]["id"]
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else None

    @settings(
        max_examples=EXAMPLES or examples,
        derandomize=EXAMPLES is None,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode), name_it=st.booleans())
    def run(case: schemathesis.Case, name_it: bool) -> None:
        bound(path, case.body, served_name, name_it)
        response = case.call_and_validate(
            base_url=server.url, headers=headers, checks=CHECKS, timeout=60
        )
        if id(case) in good_cases:
            assert response.status_code == 200, response.text

    good_cases: set[int] = set()
    if mode is GenerationMode.POSITIVE:
        for body in GOOD_BODIES.get(path, ()):
            case = operation.Case(body=body, media_type="application/json")
            good_cases.add(id(case))
            run = example(case=case, name_it=True)(run)
    run()


def test_fuzzed_operations_are_every_documented_one(qwen3_schema: schemathesis.BaseSchema):
    documented = sorted(
        (operation.method.upper(), operation.path)
        for result in qwen3_schema.get_all_operations()
        for operation in [result.ok()]
    )
    assert documented == sorted(OPERATIONS)


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=CASE_IDS)
def test_qwen3_answers_as_documented(
    qwen3_server: Server,
    qwen3_schema: schemathesis.BaseSchema,
    method: str,
    path: str,
    mode: GenerationMode,
) -> None:
    """With an API key, parsers and request templates; the fuller configuration."""
    fuzz(qwen3_server, qwen3_schema, method, path, mode, examples=6)


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=OPERATION_IDS)
def test_smollm2_answers_as_documented(
    smollm2_server: Server, smollm2_schema: schemathesis.BaseSchema, method: str, path: str
) -> None:
    """The embedded default: no API key, another tokenizer and template (schema-valid requests
    only; refusing invalid ones does not depend on the model)."""
    fuzz(smollm2_server, smollm2_schema, method, path, GenerationMode.POSITIVE, examples=3)
