"""The direct routes (``api.direct``) answer exactly as FastAPI would.

Two apps from the same settings, in process: one as shipped, one whose front middleware has an
empty direct table, so every request goes through FastAPI's routing, dependency solving and
body parsing. Each request goes to both, in the same order (so stateful routes stay in step),
and the answers must have the same status, headers and body: for valid bodies, schema failures
(table-driven and hypothesis-generated), bodies that are not JSON or that only one of the fast
path's parser and FastAPI's ``json`` accepts, wrong or missing content types, empty and
oversized bodies, on every route the direct table takes (``test_every_direct_route_has_cases``
fails for a new one without cases). Valid bodies and schema failures must also have been
answered by the direct path, not handed on: else the comparison would prove nothing.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import orjson
import pydantic_core
import pytest
from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from safetensors.numpy import save
from starlette.responses import Response
from starlette.testclient import TestClient

from tests.fake_engine import FakeEngine
from tokenwire.api.app import create_app
from tokenwire.api.asgi import FrontedApp
from tokenwire.api.direct import OFFLOAD_BYTES, DirectRoutes, direct_routes
from tokenwire.api.routes import tokenize as tokenize_routes
from tokenwire.assets import prepare
from tokenwire.settings import Settings

MAX_BYTES = 2 * OFFLOAD_BYTES  # room for bodies parsed in a worker thread, and over the limit
SETTINGS = Settings(
    model="qwen3-tiny",
    enable_rl_control=True,
    max_request_bytes=MAX_BYTES,
    max_model_len=64,  # short generations whatever a mutated body asks for
)
JSON = "application/json"
# Values two servers answering the same request cannot share: clocks and generated ids.
VOLATILE_KEYS = frozenset({"created", "created_at", "e2e_latency"})
UUID_HEX = re.compile(r"[0-9a-f]{32}")
Route = tuple[str, str]

IDS = [9707, 11, 1879, 0]  # "Hello, world!" in Qwen3's vocabulary
USER = {"role": "user", "content": "Hi"}
GREEDY = {"max_tokens": 3, "temperature": 0}
GENERATE_RESPONSE = {
    "request_id": "r",
    "choices": [{"index": 0, "token_ids": IDS, "finish_reason": "stop"}],
}

GROUP = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
SAFETENSORS = base64.b64encode(save({"a": np.ones(1, np.float32)})).decode()

# Valid bodies of every direct route (None: no body), sent in this order.
# AReaL's UpdateWeightsFromXcclRequestLora, as its RemotevLLMEngine sends both LoRA steps.
AREAL_LORA_META = {
    "names": ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"],
    "dtypes": ["float32"],
    "shapes": [[8, 64]],
    "group_name": "g",
    "lora_name": "default_lora-v1",
    "lora_int_id": 1,
    "lora_target_modules": ["q_proj", "v_proj"],
    "lora_rank": 8,
    "lora_alpha": 16,
    "lora_bias": "none",
    "base_model_name": "/models/base",
}

VALID: dict[Route, list[Any]] = {
    ("GET", "/health"): [None],
    ("GET", "/version"): [None],
    ("GET", "/v1/models"): [None],
    ("GET", "/model_info"): [None],
    ("GET", "/get_load"): [None],
    ("GET", "/load"): [None],
    ("GET", "/is_paused"): [None],
    ("GET", "/is_sleeping"): [None],
    ("GET", "/weight_info"): [None],
    ("GET", "/get_world_size"): [None],
    ("GET", "/metrics"): [None],
    ("POST", "/tokenize"): [
        {"prompt": "Hello world"},
        {"prompt": "Hello", "return_token_strs": True, "add_special_tokens": False},
        {"messages": [USER]},
        {"prompt": "Hello", "model": "another-model"},  # the pipeline's 404
    ],
    ("POST", "/detokenize"): [{"tokens": IDS}, {"tokens": []}],
    ("POST", "/v1/chat/completions/render"): [{"messages": [USER]}],
    ("POST", "/v1/completions/render"): [{"prompt": "Hello"}, {"prompt": ["a", "b"]}],
    ("POST", "/v1/chat/completions/extend"): [
        {
            "messages": [USER],
            "previous_messages": [USER, {"role": "assistant", "content": "Hello"}],
            "previous_token_ids": IDS,
        }
    ],
    ("POST", "/v1/chat/completions/derender"): [{"generate_response": GENERATE_RESPONSE}],
    ("POST", "/v1/completions/derender"): [{"generate_responses": [GENERATE_RESPONSE]}],
    ("POST", "/inference/v1/generate"): [
        {"token_ids": IDS, "sampling_params": GREEDY},
        {"token_ids": IDS, "sampling_params": {**GREEDY, "logprobs": 2}, "stream": True},
    ],
    ("POST", "/v1/chat/completions"): [
        {"messages": [USER], **GREEDY},
        {"messages": [USER], **GREEDY, "stream": True},
    ],
    ("POST", "/v1/completions"): [
        {"prompt": "Hello", **GREEDY, "logprobs": 2},
        {"prompt": "Hello", **GREEDY, "stream": True},
    ],
    ("POST", "/v1/messages"): [
        {"messages": [USER], **GREEDY, "system": "Be brief."},
        {"messages": [USER], **GREEDY, "stream": True},
    ],
    ("POST", "/v1/messages/count_tokens"): [{"messages": [USER]}],
    ("POST", "/v1/messages/render"): [{"messages": [USER], **GREEDY}],
    ("POST", "/v1/responses"): [
        {"input": "Hi", "max_output_tokens": 3, "temperature": 0},
        {"input": [USER], "max_output_tokens": 3, "temperature": 0, "stream": True},
    ],
    ("POST", "/v1/responses/render"): [{"input": "Hi", "instructions": "Be brief."}],
    ("GET", "/v1/sessions"): [None],
    ("POST", "/generate"): [
        {"input_ids": IDS, "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
        {"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
        # atropos' vLLM-server bodies (generation, then prompt logprobs)
        {"prompt": {"prompt_token_ids": IDS}, "logprobs": 0, "max_tokens": 3, "temperature": 0},
        {"prompt": {"prompt_token_ids": IDS}, "prompt_logprobs": 1, "max_tokens": 1},
    ],
    ("POST", "/abort_requests"): [{"request_ids": ["nothing-running"]}, {}],
    ("POST", "/inference/v1/abort_requests"): [{"request_ids": ["nothing-running"]}],
    ("POST", "/abort_request"): [{"rid": "nothing-running"}, {"abort_all": True}],
    ("POST", "/pause_generation"): [{"mode": "in_place"}],
    ("POST", "/continue_generation"): [None],
    ("POST", "/resume"): [None],
    ("POST", "/reset_prefix_cache"): [None],
    ("POST", "/update_weight_version"): [{"new_version": "v2"}],
    ("POST", "/update_weights"): [
        {"weight_dir": "/nonexistent/weights"},
        {"update_info": {"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]]}},
        {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]},  # skyrl-train's vLLM form
    ],
    ("POST", "/update_weights_from_disk"): [{"model_path": "/nonexistent/weights"}],
    # Weight transfer without --weight-transfer-config, over an engine with no backend: the
    # refusals above the engine.
    ("POST", "/init_weight_transfer_engine"): [{"init_info": GROUP}],
    ("POST", "/start_weight_update"): [None],
    ("POST", "/finish_weight_update"): [{"weight_version": "v3"}],
    ("POST", "/shutdown_weight_transfer_engine"): [None],
    ("POST", "/init_weights_update_group"): [{**GROUP, "backend": "gloo"}],
    ("POST", "/update_weights_from_distributed"): [
        {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]},
        {"name": "a", "dtype": "float32", "shape": [1]},
    ],
    ("POST", "/destroy_weights_update_group"): [{"group_name": "g"}],
    ("POST", "/update_weights_from_tensor"): [
        {"serialized_named_tensors": [SAFETENSORS], "load_format": "safetensors"}
    ],
    # SGLang's sleep and wake-up (sent in sorted order: the release before the resume); their
    # GET forms take an optional body, which only FastAPI reads.
    ("POST", "/release_memory_occupation"): [{"tags": ["kv_cache"]}],
    ("POST", "/resume_memory_occupation"): [{"tags": ["kv_cache"]}],
    # The frameworks' routes (AReaL's pause holds generation until /continue_generation, sent
    # after it in sorted order).
    ("POST", "/collective_rpc"): [
        {"method": "skyrl_discard_in_memory_lora", "kwargs": {"lora_name": "a"}},
        {"method": "load_weights"},
    ],
    ("POST", "/fetch_weights"): [{"target_version": 1, "sync_dir": "/nonexistent"}],
    ("POST", "/init_weight_update_communicator"): [
        {"master_addr": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
        | {"group_name": "g", "backend": "gloo", "model_dtype_str": "bfloat16"}
    ],
    ("POST", "/areal_pause_generation"): [None],
    ("POST", "/areal_continue_generation"): [None],
    ("POST", "/areal_update_weights"): [{"model_path": "/nonexistent/weights"}],
    ("POST", "/areal_init_weights_update_group"): [{**GROUP, "backend": "gloo", "group_name": "g"}],
    ("POST", "/areal_set_update_weight_meta"): [
        {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"}
    ],
    ("POST", "/areal_update_weights_xccl"): [{}],
    ("POST", "/areal_set_update_weight_meta_lora"): [AREAL_LORA_META],
    ("POST", "/areal_update_weights_lora_xccl"): [AREAL_LORA_META],
}

# Bodies each route's schema refuses (hypothesis finds more from the valid ones).
SCHEMA_FAILURES: dict[Route, list[Any]] = {
    ("POST", "/tokenize"): [
        {"prompt": 1},
        {"messages": []},
        {"messages": [{"role": 5, "content": "x"}]},
        {"prompt": "x", "add_special_tokens": "yes"},
        {"messages": [USER], "continue_final_message": True},  # a model validator's ValueError
    ],
    ("POST", "/detokenize"): [
        {"tokens": [-1]},
        {"tokens": ["a"]},
        {"tokens": [2**63]},
        {"tokens": [1.5]},
        {"tokens": "1,2"},
    ],
    ("POST", "/v1/chat/completions/render"): [{"messages": [{"role": "user", "content": 5}]}],
    ("POST", "/v1/completions/render"): [{"prompt": []}, {"prompt": None}],
    ("POST", "/v1/chat/completions/extend"): [
        {"messages": [USER], "previous_messages": [USER, USER], "previous_token_ids": IDS}
    ],
    ("POST", "/v1/chat/completions/derender"): [{"generate_response": {"choices": "x"}}],
    ("POST", "/v1/completions/derender"): [{"generate_responses": []}],
    ("POST", "/inference/v1/generate"): [
        {"token_ids": [], "sampling_params": GREEDY},
        {"token_ids": IDS},
        {"token_ids": IDS, "sampling_params": {**GREEDY, "temperature": -1}},
        {"token_ids": IDS, "sampling_params": {**GREEDY, "n": "two"}},
        {"token_ids": IDS, "sampling_params": {**GREEDY, "unknown": 1}},
    ],
    ("POST", "/v1/chat/completions"): [{"messages": [USER], "max_tokens": 0}],
    ("POST", "/v1/completions"): [{"prompt": "x", "logprobs": -5}],
    ("POST", "/v1/messages"): [{"messages": [USER]}, {"messages": [{"role": "user"}]}],
    ("POST", "/v1/messages/count_tokens"): [{"messages": []}],
    ("POST", "/v1/messages/render"): [{"messages": [USER], "max_tokens": 0}],
    ("POST", "/v1/responses"): [{"input": [{"type": "nope"}]}, {"input": 1}],
    ("POST", "/v1/responses/render"): [{"input": "x", "max_output_tokens": 0}],
    ("POST", "/generate"): [
        {"sampling_params": {}},
        {"text": "x", "input_ids": IDS},
        {"prompt": {"prompt_token_ids": []}},
        {"prompt": {"prompt_token_ids": IDS}, "unknown": 1},
    ],
    ("POST", "/abort_requests"): [{"request_ids": "x"}],
    ("POST", "/inference/v1/abort_requests"): [{}],
    ("POST", "/abort_request"): [{"abort_all": "maybe"}],
    ("POST", "/pause_generation"): [{"mode": "forever"}],
    ("POST", "/update_weight_version"): [{"new_version": ""}, {}],
    ("POST", "/update_weights"): [
        {"weight_dir": ""},
        {"update_info": {"names": ["a"]}},
        {"names": ["a"], "dtypes": ["float32"], "shapes": [["1"]]},
    ],
    ("POST", "/update_weights_from_disk"): [{"model_path": 3}],
    ("POST", "/init_weight_transfer_engine"): [{"init_info": {**GROUP, "rank_offset": 2}}, {}],
    ("POST", "/finish_weight_update"): [{"weight_version": ""}],
    ("POST", "/init_weights_update_group"): [{**GROUP, "master_port": 0}],
    ("POST", "/update_weights_from_distributed"): [{"names": "a"}],
    ("POST", "/destroy_weights_update_group"): [{"group_name": 1}],
    ("POST", "/update_weights_from_tensor"): [{"serialized_named_tensors": []}],
    ("POST", "/release_memory_occupation"): [{"tags": "weights"}],
    ("POST", "/resume_memory_occupation"): [{"tags": 5}],
    ("POST", "/collective_rpc"): [{"method": 1}, {}],
    ("POST", "/fetch_weights"): [{}, {"target_version": "3"}],
    ("POST", "/init_weight_update_communicator"): [{"master_addr": "127.0.0.1"}],
    ("POST", "/areal_update_weights"): [{"model_path": ""}],
    ("POST", "/areal_init_weights_update_group"): [{**GROUP, "master_port": "x"}],
    ("POST", "/areal_set_update_weight_meta"): [
        {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]},
        {"names": ["a"], "dtypes": ["float32"], "shapes": [[-1]], "group_name": "g"},
    ],
    ("POST", "/areal_set_update_weight_meta_lora"): [
        {k: v for k, v in AREAL_LORA_META.items() if k != "lora_int_id"},
        {**AREAL_LORA_META, "lora_rank": 0},
    ],
    ("POST", "/areal_update_weights_lora_xccl"): [
        {**AREAL_LORA_META, "lora_target_modules": 3},
        {**AREAL_LORA_META, "lora_alpha": "16"},
    ],
}

# Bodies that are not valid JSON, or that only one of the parsers takes (greedy where valid).
RAW_BODIES: list[bytes] = [
    b"",
    b"   ",
    b'{"prompt": ',
    b"hello",
    b"null",
    b"[]",
    b"1",
    b'"x"',
    b"true",
    b"{}",
    b'{"prompt": NaN}',
    b'{"prompt": Infinity}',
    b'{"prompt": 1e999}',
    b'{"prompt": 123456789012345678901234567890}',
    b'\xef\xbb\xbf{"prompt": "x", "temperature": 0, "max_tokens": 1}',
    b'{"prompt": "\xff"}',
    b'{"prompt": "\xed\xa0\x80"}',
    b'{"prompt": 1, "prompt": "x", "temperature": 0, "max_tokens": 1}',
    b'{"prompt": "a\x01b"}',
    b"{'prompt': 'x'}",
    b'{"prompt": "x"} trailing',
    b'{"prompt": "x", "temperature": 0, "max_tokens": 1}\n',
    b'{"prompt": "\\ud800"}',
    b'{"prompt": "\\ud83d\\ude00", "temperature": 0, "max_tokens": 1}',
    '{"prompt": "x", "temperature": 0, "max_tokens": 1}'.encode("utf-16"),
    b"[" * 5000 + b"]" * 5000,
]

CONTENT_TYPES: list[str | None] = [
    None,
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=utf-8",
    "Application/JSON",
    "application/json;",
    "application/vnd.api+json",
    "application/+json",
    "application/foo/bar+json",
    "application/json, text/plain",
    "application/jsonx",
    "application",
    "text/json",
    "json",
]


def direct_table(app: FrontedApp) -> DirectRoutes:
    """The app's direct table, as its front middleware holds it."""
    assert app.front is not None
    return app.front.direct


def without_direct(app: FrontedApp) -> FrontedApp:
    """The same app with its direct table empty: every request goes through FastAPI."""
    assert app.front is not None
    app.front.direct = {}
    return app


@dataclass
class Pair:
    direct: TestClient
    plain: TestClient
    table: DirectRoutes
    answered: list[str]  # the paths the direct table answered, in order
    answered_directly: bool = False  # whether it answered the last request checked

    def check(
        self, method: str, path: str, body: bytes | None = None, content_type: str | None = JSON
    ) -> httpx.Response:
        """Send the request to both apps; their answers must be the same."""
        headers = {"X-Request-Id": "direct-test"}
        if content_type is not None and body is not None:
            headers["Content-Type"] = content_type
        try:
            before = len(self.answered)
            answers = [
                client.request(method, path, content=body, headers=headers)
                for client in (self.direct, self.plain)
            ]
            self.answered_directly = len(self.answered) > before
        finally:
            if path == "/pause_generation":  # keep generation going for the next request
                for client in (self.direct, self.plain):
                    client.post("/resume")
        assert_same(*answers, f"{method} {path} {content_type} {body!r:.200}")
        return answers[0]

    def check_json(self, method: str, path: str, value: Any) -> httpx.Response:
        # json, not orjson: integers past 64 bits too.
        return self.check(method, path, None if value is None else json.dumps(value).encode())


def assert_same(direct: httpx.Response, plain: httpx.Response, what: str) -> None:
    assert direct.status_code == plain.status_code, (what, direct.text, plain.text)
    if direct.content == plain.content:
        assert sorted(direct.headers.multi_items()) == sorted(plain.headers.multi_items()), what
        return
    # Different ids or clocks: the same once those are set aside, and each length its own.
    assert normalized(direct) == normalized(plain), (what, direct.text, plain.text)
    for response in (direct, plain):
        assert int(response.headers.get("content-length", len(response.content))) == len(
            response.content
        )
    assert headers_but_length(direct) == headers_but_length(plain), what


def headers_but_length(response: httpx.Response) -> list[tuple[str, str]]:
    return sorted((k, v) for k, v in response.headers.multi_items() if k != "content-length")


def normalized(response: httpx.Response) -> Any:
    content = response.content
    if response.headers["content-type"].startswith("text/plain"):  # /metrics: the same metrics
        return [line for line in response.text.splitlines() if line.startswith("# ")]
    if content.startswith(b"data: "):  # server-sent events
        events = content.split(b"\n\n")
        return [event_value(event.removeprefix(b"data: ")) for event in events]
    if content.startswith(b"event: "):  # named events (Anthropic's, OpenAI Responses')
        events = [event.partition(b"\ndata: ") for event in content.split(b"\n\n")]
        return [(name, event_value(data)) for name, _, data in events]
    return without_volatile(orjson.loads(content))


def event_value(data: bytes) -> Any:
    return data if data in (b"", b"[DONE]") else without_volatile(orjson.loads(data))


def without_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            key: "<volatile>" if key in VOLATILE_KEYS else without_volatile(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [without_volatile(item) for item in value]
    if isinstance(value, str):
        return UUID_HEX.sub("<uuid>", value)
    return value


def started(client: TestClient) -> TestClient:
    deadline = time.monotonic() + 120
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the model did not load"
        time.sleep(0.05)
    return client


def recording(table: DirectRoutes, answered: list[str]) -> None:
    """Note in ``answered`` each request a route of ``table`` answers itself."""
    for route in set(table.values()):

        async def answer(
            scope: Any, receive: Any, send: Any, body: bytes | None, route=route, inner=route.answer
        ) -> bool:
            done = await inner(scope, receive, send, body)
            if done:
                answered.append(route.route.path)
            return done

        route.answer = answer  # type: ignore[method-assign]


def fake_engine() -> FakeEngine:
    """The same scripted answers for both apps: no model forward is needed to compare them."""
    return FakeEngine.for_model(prepare(SETTINGS.model), max_model_len=SETTINGS.max_model_len)


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    shipped = create_app(SETTINGS, engine=fake_engine())
    table = direct_table(shipped)
    answered: list[str] = []
    recording(table, answered)
    plain = without_direct(create_app(SETTINGS, engine=fake_engine()))
    with TestClient(shipped) as direct_client:
        started(direct_client)
        with TestClient(plain) as plain_client:
            yield Pair(direct_client, started(plain_client), table, answered)


def body_routes(pair: Pair) -> list[Route]:
    return sorted(key for key, route in pair.table.items() if route.validate is not None)


def test_every_direct_route_has_cases(pair: Pair) -> None:
    assert set(pair.table) == set(VALID)
    assert set(SCHEMA_FAILURES) == set(body_routes(pair))


@pytest.mark.parametrize("route", sorted(VALID), ids=" ".join)
def test_valid_bodies(pair: Pair, route: Route) -> None:
    for value in VALID[route]:
        pair.check_json(*route, value)
        assert pair.answered_directly


@pytest.mark.parametrize("route", sorted(SCHEMA_FAILURES), ids=" ".join)
def test_schema_failures(pair: Pair, route: Route) -> None:
    for value in SCHEMA_FAILURES[route]:
        assert pair.check_json(*route, value).status_code == 400
        assert pair.answered_directly


@pytest.mark.parametrize("route", sorted(SCHEMA_FAILURES), ids=" ".join)
def test_bodies_that_are_not_plain_json(pair: Pair, route: Route) -> None:
    for body in RAW_BODIES:
        pair.check(*route, body)


# Values a fast parser may read otherwise than ``json`` (orjson did: integers past 64 bits as
# floats, and nesting to 1024 levels where ``json`` stops near 1000 less the stack in use).
ODD_VALUES: list[bytes] = [
    str(2**63).encode(),
    str(2**64 - 1).encode(),
    str(-(2**63)).encode(),
    str(2**64).encode(),
    str(-(2**63) - 1).encode(),
    b"1e400",
    b"0.1000000000000000055511151231257827",
    b"[" * 150 + b"]" * 150,
    b"[" * 500 + b"]" * 500,
    b"[" * 950 + b"]" * 950,
    b"[" * 1020 + b"]" * 1020,
]


@pytest.mark.parametrize("route", sorted(SCHEMA_FAILURES), ids=" ".join)
def test_odd_values(pair: Pair, route: Route) -> None:
    """Each as an extra field of a valid body, and as every integer of it."""
    valid = orjson.dumps(VALID[route][0])
    for value in ODD_VALUES:
        pair.check(*route, b'{"padding": ' + value + b", " + valid[1:])
        pair.check(*route, re.sub(rb"(?<![.\w])[0-9]+(?![.\w])", value, valid))


@pytest.mark.parametrize("route", sorted(SCHEMA_FAILURES), ids=" ".join)
def test_content_types(pair: Pair, route: Route) -> None:
    body = orjson.dumps(VALID[route][0])
    for content_type in CONTENT_TYPES:
        pair.check(*route, body, content_type)
        pair.check(*route, b"", content_type)


@pytest.mark.parametrize("route", sorted(VALID), ids=" ".join)
def test_sizes(pair: Pair, route: Route) -> None:
    """Bodies over the limit, just under it (parsed in a worker thread), and junk on a route
    that takes no body."""
    for size in (MAX_BYTES + 1, MAX_BYTES - 1, OFFLOAD_BYTES + 1):
        pad = size - len(b'{"padding": ""}')
        pair.check(*route, b'{"padding": "' + b"a" * pad + b'"}')
    pair.check(*route, b"not json")
    big = {"tokens": list(range(50_000)) * 2}  # over OFFLOAD_BYTES, valid or not by route
    pair.check_json(*route, big)
    pair.check_json(*route, {"tokens": ["x"] * 50_000})


# Keys a mutation leaves alone: without them two engines would sample differently.
PROTECTED = frozenset({"temperature"})
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=4,
)


def paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Paths into a JSON value whose subtree holds no protected key."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in PROTECTED:
                if not (isinstance(item, dict) and PROTECTED & set(item)):
                    yield (*prefix, key)
                yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield (*prefix, index)
            yield from paths(item, (*prefix, index))


def mutate(value: Any, path: tuple, new: Any, delete: bool) -> Any:
    if not path:
        return new
    head, *rest = path
    if isinstance(value, dict):
        copy = dict(value)
        if delete and not rest:
            copy.pop(head)
        else:
            copy[head] = mutate(value[head], tuple(rest), new, delete)
        return copy
    copy_list = list(value)
    copy_list[head] = mutate(value[head], tuple(rest), new, delete)
    return copy_list


@settings(max_examples=250, deadline=None, derandomize=True)
@given(data=st.data())
def test_mutated_bodies(pair: Pair, data: st.DataObject) -> None:
    route = data.draw(st.sampled_from(sorted(SCHEMA_FAILURES)))
    valid = data.draw(st.sampled_from([v for v in VALID[route] if isinstance(v, dict)]))
    options = [(), *paths(valid)]
    path = data.draw(st.sampled_from(options))
    delete = data.draw(st.booleans()) and bool(path)
    new = data.draw(JSON_VALUES)
    if not path and data.draw(st.booleans()):  # a key of the top level, known or not
        key = data.draw(st.sampled_from([*sorted(valid), "extra"]) | st.text(max_size=4))
        new = {**valid, key: new} if key not in PROTECTED else valid
    pair.check(*route, json.dumps(mutate(valid, path, new, delete)).encode())  # null too
    assert pair.answered_directly


def request_counts(client: TestClient) -> list[str]:
    lines = client.get("/metrics").text.splitlines()
    # /health was polled more on one than the other while the models loaded.
    return [
        line
        for line in lines
        if line.startswith("tokenwire_requests_total") and '"/health"' not in line
    ]


def test_metrics_name_the_same_routes(pair: Pair) -> None:
    """After the requests above: both apps counted each under the same route and status."""
    assert request_counts(pair.direct) == request_counts(pair.plain)


# JSON texts for the parser property: numbers of every form, escapes, and near-misses.
JSON_NUMBER = r"-?(0|[1-9][0-9]{0,30})(\.[0-9]{1,25})?([eE][-+]?[0-9]{1,3})?"
JSON_TEXTS = (
    st.from_regex(JSON_NUMBER, fullmatch=True)
    | st.from_regex(r'"(\\u[0-9a-fA-F]{4}|\\[nrtbf"/\\]|[ -~]){0,6}"', fullmatch=True)
    | st.builds(
        json.dumps, JSON_VALUES, ensure_ascii=st.booleans(), indent=st.sampled_from([None, 1])
    )
    | st.text(alphabet=' \t\n[]{}",:.-+eE0123456789aflnrstuINay\\\x00\x0c\u00e9', max_size=12)
)


@given(text=JSON_TEXTS)
@example(text="123456789012345678901234567890")
@example(text="-0.0")
@example(text="1e400")
@example(text='"\\ud800\\u0041"')
@example(text='"\\udbff\\udfff"')
@example(text="[" * 200 + "]" * 200)
def test_the_parser_reads_what_it_takes_as_json_does(text: str) -> None:
    """The fast path's parser (pydantic-core's) either refuses a body, so FastAPI answers it,
    or reads it to the value FastAPI's ``json.loads`` reads: the same types, -0.0 included."""
    body = text.encode()
    try:
        value = pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError:
        return
    assert repr(value) == repr(json.loads(body))


class Item(BaseModel):
    name: str


def test_a_route_fastapi_would_not_pick_is_left_to_it() -> None:
    first, second = APIRouter(), APIRouter()

    @first.post("/items/{name}")
    async def by_name(name: str, request: Request) -> Response:
        return Response()

    @first.post("/items/all")  # shadowed by the path parameter above
    async def all_items(body: Item, request: Request) -> Response:
        return Response()

    @first.post("/same")
    async def same_first(body: Item, request: Request) -> Response:
        return Response()

    @second.post("/same")
    async def same_second(body: Item, request: Request) -> Response:
        return Response()

    @second.post("/serialised")  # FastAPI serialises what it returns
    async def serialised(body: Item) -> dict:
        return {}

    table = direct_routes([first, second])
    assert set(table) == {("POST", "/same")}
    assert table[("POST", "/same")].endpoint is same_first


def reshaped_validate(route: APIRoute, monkeypatch: pytest.MonkeyPatch) -> None:
    field = SimpleNamespace(field_info=route.body_field.field_info, validate=lambda value: value)
    monkeypatch.setattr(route, "body_field", field)


BREAKAGES = {
    "private attribute gone": lambda route, m: m.delattr(route, "_embed_body_fields"),
    "dependant gone": lambda route, m: m.delattr(route, "dependant"),
    "validate reshaped": reshaped_validate,
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_fastapi_internals_gone_fall_back_to_fastapi(
    breakage: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A FastAPI upgrade that removes or reshapes what ``api.direct`` reads leaves the route
    to FastAPI, with a warning: answered as before, not broken."""
    (route,) = [r for r in tokenize_routes.router.routes if getattr(r, "path", "") == "/tokenize"]
    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, "tokenwire.api"):
        BREAKAGES[breakage](route, patch)
        app = create_app(SETTINGS)
    table = direct_table(app)
    assert ("POST", "/tokenize") not in table and ("POST", "/detokenize") in table
    assert "/tokenize is left to FastAPI" in caplog.text
    client = TestClient(app)  # no lifespan: no model, FastAPI's answers are enough
    assert client.post("/tokenize", json={"prompt": 1}).json()["error"]["param"] == "prompt"
    assert client.post("/tokenize", json={"prompt": "x"}).status_code == 503
