"""Schema fuzzing: whatever a client sends, no endpoint answers 5xx; and streams that drop
mid-way lose nothing and free every engine slot."""

from __future__ import annotations

import asyncio
import random

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import Server

POST_ROUTES = [
    "/tokenize",
    "/detokenize",
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/chat/completions/extend",
    "/inference/v1/generate",
    "/abort_requests",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/messages/render",
    "/v1/responses",
    "/v1/responses/render",
]

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)
# Keys the endpoints know, so the fuzzer reaches past the first validation layer.
KNOWN_KEYS = st.sampled_from(
    [
        "prompt",
        "messages",
        "tokens",
        "token_ids",
        "sampling_params",
        "model",
        "stream",
        "generate_response",
        "generate_responses",
        "chat_request",
        "stream_state",
        "tools",
        "chat_template_kwargs",
        "request_ids",
        "features",
        "content_parts",
        "max_tokens",
        "n",
        "logprobs",
        "top_logprobs",
        "stop",
        "prompt_token_ids",
        "previous_token_ids",
        "previous_messages",
        "generate_chunk",
        "role",
        "content",
        "system",
        "tool_choice",
        "thinking",
        "input",
        "instructions",
        "type",
    ]
)
SMALL_INTS = st.integers(-3, 151700)
BODIES = st.one_of(
    JSON,
    st.dictionaries(KNOWN_KEYS, JSON | SMALL_INTS | st.lists(SMALL_INTS, max_size=6), max_size=5),
)
# A valid-looking generate must still finish quickly.
CAPS = {"max_tokens": 4, "max_output_tokens": 4}


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(POST_ROUTES), body=BODIES)
def test_no_5xx_for_any_body(qwen3: httpx.Client, route: str, body: object) -> None:
    if isinstance(body, dict):
        for key, value in CAPS.items():
            if key in body:
                body[key] = value
        if isinstance(body.get("sampling_params"), dict):
            body["sampling_params"]["max_tokens"] = 4
        if route == "/v1/responses":  # {"input": "x"} alone is valid: up to the context
            body.setdefault("max_output_tokens", 4)
    response = qwen3.post(route, json=body)
    assert response.status_code < 500, (route, body, response.text)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(POST_ROUTES), raw=st.binary(max_size=64))
def test_no_5xx_for_raw_bytes(qwen3: httpx.Client, route: str, raw: bytes) -> None:
    response = qwen3.post(route, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (route, raw, response.text)


def test_streams_with_random_disconnects_free_every_slot(qwen3_server: Server) -> None:
    """64 concurrent streams; a third drop mid-way. The rest finish whole; no slot leaks."""
    rng = random.Random(0)
    headers = {"Authorization": f"Bearer {qwen3_server.api_key}"}

    async def one(client: httpx.AsyncClient, index: int) -> tuple[bool, int, bool]:
        drop_after = rng.randint(1, 5) if index % 3 == 0 else None
        body = {
            "token_ids": [9707, 1879, 11],
            "stream": True,
            "sampling_params": {
                "max_tokens": 24,
                "ignore_eos": True,
                "temperature": 1.0,
                "seed": index,
            },
        }
        tokens = 0
        async with client.stream("POST", "/inference/v1/generate", json=body) as response:
            assert response.status_code == 200
            events = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return False, tokens, True
                chunk = httpx.Response(200, content=line[6:]).json()
                tokens += len(chunk["choices"][0]["token_ids"]) if chunk["choices"] else 0
                events += 1
                if drop_after is not None and events >= drop_after:
                    return True, tokens, False  # leaving the block closes the connection
        return False, tokens, False

    async def main() -> list[tuple[bool, int, bool]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            base_url=qwen3_server.url, headers=headers, timeout=120, limits=limits
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    for dropped, tokens, done in results:
        if not dropped:
            assert done and tokens == 24
    with qwen3_server.client() as client:
        deadline = 30.0
        while deadline > 0:
            metrics = client.get("/metrics").text
            running = [
                line
                for line in metrics.splitlines()
                if line.startswith("tokenwire_engine_running_requests ")
            ]
            waiting = [
                line
                for line in metrics.splitlines()
                if line.startswith("tokenwire_engine_waiting_requests ")
            ]
            if running[0].endswith(" 0.0") and waiting[0].endswith(" 0.0"):
                break
            asyncio.run(asyncio.sleep(0.1))
            deadline -= 0.1
        assert deadline > 0, "engine slots were not freed"
