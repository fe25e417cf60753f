"""Hostile request chat templates on the real qwen3 server (issue 9, item 5).

The server trusts request templates and renders them in worker processes with a 5 s time cap,
a 256 MiB memory cap and the default 4 Mi-character output cap (conftest). Each kind of
amplification must end in a 400 naming its cap while innocent requests keep being answered.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import Server, assert_error
from tests.fast_app import fast_client

MESSAGES = [{"role": "user", "content": "hi"}]
ECHO = "{% for m in messages %}{{ m.content }}{% endfor %}"
OUTPUT_CAP = "over the output cap"
# (template, the cap its 400 names)
HOSTILE = {
    "replace": (
        '{% for i in range(10) %}{{ ("x" * 1000)|replace("x", "y" * 100000)|length }}{% endfor %}',
        OUTPUT_CAP,
    ),
    "indent": ('{{ "a\\nb"|indent(400000000) }}', OUTPUT_CAP),
    # A filter call is a few instructions of fuel however much work it does (MiniJinja charges
    # its own string operations by length, so a loop of ``~`` runs out of fuel in ~1 s on a quiet
    # machine): this one burns ~45 s of CPU before the fuel ends, so only the clock stops it.
    "slow": (
        '{% set s = "\\n" * 1000000 %}{% for i in range(100000) %}{% set t = s|indent(1) %}'
        "{% endfor %}{{ 1 }}",
        "over the time cap of 5 s (--request-template-timeout-s)",
    ),
    "memory": (
        '{% set a = "x" * 100000000 %}{% set b = a ~ a %}{% set c = b ~ b %}{{ 1 }}',
        "over the memory cap (--request-template-memory-bytes)",
    ),
}


# The tests that need no socket run on the test server's own app over a fake engine (see
# ``tests.fast_app.fast_client``); the ones that time out a client or race many stay on the
# real server.
qwen3 = fast_client("fast_qwen3_app", "qwen3")


def tokenize(
    client: httpx.Client, template: str | None = None, timeout: float | None = None, **extra: object
) -> httpx.Response:
    """``timeout``: the client's own unless given (TestClient takes none)."""
    body: dict[str, object] = {"messages": MESSAGES, **extra}
    if template is not None:
        body["chat_template"] = template
    if timeout is None:
        return client.post("/tokenize", json=body)
    return client.post("/tokenize", json=body, timeout=timeout)


def test_hostile_templates_get_400s_while_others_are_served(qwen3_server: Server) -> None:
    bad = [source for source, _ in HOSTILE.values()] * 2
    with qwen3_server.client() as client, ThreadPoolExecutor(len(bad) + 1) as pool:
        futures = [pool.submit(tokenize, client, source) for source in bad]
        # An innocent request template waits for a free worker, then renders.
        good_template = pool.submit(tokenize, client, ECHO, add_special_tokens=False)
        served = 0
        while not all(future.done() for future in futures):
            assert client.get("/health", timeout=60).status_code == 200
            response = tokenize(client)
            assert response.status_code == 200, response.text
            served += 1
        assert served >= 1
        for source, future in zip(bad, futures, strict=True):
            cap = next(cap for s, cap in HOSTILE.values() if s == source)
            error = assert_error(future.result(), 400, cap)
            assert error["param"] == "chat_template"
        good = good_template.result()
        assert good.status_code == 200, good.text
        expected = client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False})
        assert good.json()["tokens"] == expected.json()["tokens"]


def test_indent_of_400_million_is_a_400(qwen3: httpx.Client) -> None:
    error = assert_error(tokenize(qwen3, HOSTILE["indent"][0]), 400, "indent would make more")
    assert "(--request-template-max-chars)" in error["message"]
    assert error["param"] == "chat_template"


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions/render", "/v1/chat/completions", "/tokenize"]
)
def test_every_chat_entry_point_applies_the_caps(qwen3: httpx.Client, path: str) -> None:
    body = {"messages": MESSAGES, "chat_template": HOSTILE["replace"][0], "max_tokens": 1}
    assert_error(qwen3.post(path, json=body), 400, OUTPUT_CAP)


def test_derender_renders_the_request_template_under_the_caps(qwen3: httpx.Client) -> None:
    # Without prompt_token_ids the reasoning parser renders the prompt to see an open <think>.
    chat_request = {"messages": MESSAGES, "chat_template": HOSTILE["indent"][0]}
    body = {
        "chat_request": chat_request,
        "generate_response": {
            "request_id": "r1",
            "choices": [{"index": 0, "token_ids": [9707], "finish_reason": "length"}],
        },
    }
    assert_error(qwen3.post("/v1/chat/completions/derender", json=body), 400, OUTPUT_CAP)


def test_extend_renders_the_request_template_under_the_caps(qwen3: httpx.Client) -> None:
    previous = [*MESSAGES, {"role": "assistant", "content": "hello"}]
    body = {
        "previous_token_ids": [9707],
        "previous_messages": previous,
        "messages": [{"role": "user", "content": "again"}],
        "chat_template": HOSTILE["replace"][0],
    }
    assert_error(qwen3.post("/v1/chat/completions/extend", json=body), 400, OUTPUT_CAP)
    # A harmless request template renders there too.
    body["chat_template"] = ECHO + "<|im_end|>{% if add_generation_prompt %}>{% endif %}"
    response = qwen3.post("/v1/chat/completions/extend", json=body)
    assert response.status_code == 200, response.text


def test_a_worker_abandoned_mid_render_is_replaced(qwen3_server: Server) -> None:
    with qwen3_server.client() as client, pytest.raises(httpx.TimeoutException):
        tokenize(client, HOSTILE["slow"][0], timeout=0.3)
    with qwen3_server.client() as client:
        for _ in range(3):  # more than the workers: each one answers
            response = tokenize(client, ECHO, add_special_tokens=False)
            assert response.status_code == 200, response.text


def test_template_errors_are_still_400s(qwen3: httpx.Client) -> None:
    assert_error(tokenize(qwen3, "{% if %}"), 400, "Invalid chat template")
    error = assert_error(tokenize(qwen3, "{{ raise_exception('nope') }}"), 400, "nope")
    assert error["param"] == "messages"
