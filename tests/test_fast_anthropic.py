"""/v1/messages over the fake engine through the real ``anthropic`` SDK, streaming and not:
thinking, text and tool_use blocks from Qwen3's parsers, stop reasons, usage, tool results fed
back, count_tokens and render, and malformed requests refused with a 400."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest

from tests.chat_fixtures import TOOLS
from tests.conftest import API_KEY
from tests.fast_app import FastApp

IM_END = 151645  # Qwen3's
THINK_AND_CALL = (
    "<think>\nThe user wants the weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>"
)
ANTHROPIC_TOOLS = [
    {
        "name": tool["function"]["name"],
        "description": tool["function"]["description"],
        "input_schema": tool["function"]["parameters"],
    }
    for tool in TOOLS
]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def anthropic_client(fast: FastApp, **kwargs: Any) -> anthropic.Anthropic:
    """The real Anthropic SDK, sending through the app's TestClient."""
    return anthropic.Anthropic(
        base_url="http://testserver",
        api_key=API_KEY,
        http_client=fast.client,
        max_retries=0,
        **kwargs,
    )


def named_events(fast: FastApp, path: str, body: dict[str, Any]) -> list[str]:
    """The event types of a raw named stream (``event: TYPE`` then its ``data:``, whose ``type``
    matches); checks that it ends with ``data: [DONE]`` as the unnamed streams do."""
    with fast.client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        raw = response.read().decode()
    frames = raw.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""], raw[-200:]
    types = []
    for frame in frames[:-2]:
        event, data = frame.split("\n")
        types.append(event.removeprefix("event: "))
        assert json.loads(data.removeprefix("data: "))["type"] == types[-1]
    return types


# A history whose assistant turn called a tool, and the user turn that answers it.
CALLED = [
    *WEATHER,
    {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "P"}}
        ],
    },
]
TOOL_RESULT = {
    "role": "user",
    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}],
}


def script(fast: FastApp, text: str) -> list[int]:
    ids = [*fast.tokenize(text), IM_END]
    fast.engine.script = lambda *_: ids
    return ids


def test_message_with_thinking_and_tool_use(fast_qwen3: FastApp) -> None:
    ids = script(fast_qwen3, THINK_AND_CALL)
    client = anthropic_client(fast_qwen3)
    message = client.messages.create(
        model="qwen3-tiny", max_tokens=64, messages=WEATHER, tools=ANTHROPIC_TOOLS
    )
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == "\nThe user wants the weather.\n"
    call = message.content[1]
    assert call.name == "get_weather"
    assert call.input == {"city": "Paris", "unit": "celsius"}
    assert message.stop_reason == "tool_use"
    assert message.usage.output_tokens == len(ids)
    prompt = fast_qwen3.engine.calls[-1].prompt_token_ids
    assert message.usage.input_tokens == len(prompt)
    assert message.id.startswith("msg_") and message.role == "assistant"


def test_message_stream_matches_whole(fast_qwen3: FastApp) -> None:
    script(fast_qwen3, THINK_AND_CALL)
    client = anthropic_client(fast_qwen3)
    whole = client.messages.create(
        model="qwen3-tiny", max_tokens=64, messages=WEATHER, tools=ANTHROPIC_TOOLS
    )
    with client.messages.stream(
        model="qwen3-tiny", max_tokens=64, messages=WEATHER, tools=ANTHROPIC_TOOLS
    ) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "message_delta" in events
    strip = [{k: v for k, v in b.model_dump().items() if k != "id"} for b in final.content]
    assert strip == [{k: v for k, v in b.model_dump().items() if k != "id"} for b in whole.content]
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_framing_ends_with_done(fast_qwen3: FastApp) -> None:
    script(fast_qwen3, "Paris is nice.")
    body = {"model": "qwen3-tiny", "max_tokens": 64, "messages": WEATHER}
    events = named_events(fast_qwen3, "/v1/messages", body)
    assert events[0] == "message_start" and events[-1] == "message_stop"


def test_text_stop_sequence_and_max_tokens(fast_qwen3: FastApp) -> None:
    script(fast_qwen3, "Paris is nice. Really.")
    client = anthropic_client(fast_qwen3)
    message = client.messages.create(
        model="qwen3-tiny", max_tokens=64, messages=WEATHER, stop_sequences=["Really"]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "Really"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "Paris is nice. "
    short = client.messages.create(model="qwen3-tiny", max_tokens=2, messages=WEATHER)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    with client.messages.stream(model="qwen3-tiny", max_tokens=64, messages=WEATHER) as stream:
        text = "".join(stream.text_stream)
        assert stream.get_final_message().stop_reason == "end_turn"
    assert text == "Paris is nice. Really."


def test_thinking_signature_is_opaque_and_comes_back(fast_qwen3: FastApp) -> None:
    """Never empty (pydantic-ai drops a block signed ""), the same whole and streamed (where it
    comes last, in a signature_delta), and a block sent back with it, or a redacted_thinking
    block, renders as the history without them would."""
    script(fast_qwen3, THINK_AND_CALL)
    client = anthropic_client(fast_qwen3)
    kwargs = {"model": "qwen3-tiny", "max_tokens": 64, "messages": WEATHER}
    whole = client.messages.create(**kwargs, tools=ANTHROPIC_TOOLS)
    signed = whole.content[0]
    assert signed.type == "thinking" and len(signed.signature) >= 32
    with client.messages.stream(**kwargs, tools=ANTHROPIC_TOOLS) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].signature == signed.signature
    types = named_events(fast_qwen3, "/v1/messages", {**kwargs, "tools": ANTHROPIC_TOOLS})
    stop = types.index("content_block_stop")
    assert types[stop - 1] == "content_block_delta"  # the signature_delta
    reply = [block.model_dump(exclude_none=True) for block in whole.content]
    result = {"type": "tool_result", "tool_use_id": whole.content[1].id, "content": "sunny"}
    redacted = {"type": "redacted_thinking", "data": "opaque"}
    renders = []
    for assistant in (reply, [redacted, *reply]):
        messages = [
            *WEATHER,
            {"role": "assistant", "content": assistant},
            {"role": "user", "content": [result]},
        ]
        body = {**kwargs, "tools": ANTHROPIC_TOOLS, "messages": messages}
        response = fast_qwen3.client.post("/v1/messages/render", json=body)
        assert response.status_code == 200, response.text
        renders.append(response.json()["token_ids"])
    assert renders[0] == renders[1]


def test_tool_result_renders_as_tool_message(fast_qwen3: FastApp) -> None:
    """A tool_result round trip renders exactly as the chat route renders the same history."""
    history = [
        *WEATHER,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Weather.", "signature": ""},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "P"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    client = fast_qwen3.client
    body = {"model": "qwen3-tiny", "max_tokens": 8, "messages": history, "system": "Be brief."}
    rendered = client.post("/v1/messages/render", json={**body, "tools": ANTHROPIC_TOOLS})
    assert rendered.status_code == 200, rendered.text
    chat = [
        {"role": "system", "content": "Be brief."},
        *WEATHER,
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Weather.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "P"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
    ]
    expected = client.post(
        "/v1/chat/completions/render", json={"messages": chat, "max_tokens": 8, "tools": TOOLS}
    )
    assert rendered.json()["token_ids"] == expected.json()["token_ids"]
    count = anthropic_client(fast_qwen3).messages.count_tokens(
        model="qwen3-tiny", messages=history, system="Be brief.", tools=ANTHROPIC_TOOLS
    )
    assert count.input_tokens == len(expected.json()["token_ids"])


@pytest.mark.parametrize(
    ("messages", "extra", "message_part"),
    [
        (
            [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}],
            {},
            "the previous assistant message does not have",
        ),
        # Anthropic's pairing: a result answers a call of the previous assistant message, once,
        # and every call there is answered in the next user message.
        (
            [*CALLED, TOOL_RESULT, {"role": "assistant", "content": "Sunny."}, TOOL_RESULT],
            {"tools": ANTHROPIC_TOOLS},
            "messages.4.content.0: tool_result for tool_use id 'toolu_1', which the previous",
        ),
        (
            [*CALLED, {"role": "user", "content": TOOL_RESULT["content"] * 2}],
            {"tools": ANTHROPIC_TOOLS},
            "messages.2.content.1: tool_result for tool_use id 'toolu_1'",
        ),
        (
            [*CALLED, {"role": "user", "content": "And tomorrow?"}],
            {"tools": ANTHROPIC_TOOLS},
            "messages.1: tool_use ids ['toolu_1'] have no tool_result",
        ),
        # A forcing tool choice without tools was dropped silently (text answered).
        (WEATHER, {"tool_choice": {"type": "any"}}, "offers no tools"),
        (WEATHER, {"tool_choice": {"type": "tool", "name": "get_weather"}}, "offers no tools"),
        (
            WEATHER,
            {"tools": [*ANTHROPIC_TOOLS, ANTHROPIC_TOOLS[0]]},
            "tools: tool names must be unique: 'get_weather' is offered twice",
        ),
        (
            WEATHER,
            {"tools": [{"name": "f", "input_schema": {"type": "string"}}]},
            "tools.0.input_schema: a tool's schema must have type 'object'",
        ),
        ([{"role": "user", "content": [{"type": "video", "x": 1}]}], {}, "messages"),
        ([{"role": "user", "content": [{"type": "text"}]}], {}, "text"),
        ([{"role": "system", "content": "x"}], {}, "role"),
        (WEATHER, {"max_tokens": 0}, "max_tokens"),
        (WEATHER, {"tool_choice": {"type": "tool"}}, "tool_choice"),
        (
            [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}],
            {},
            "cannot be in a user message",
        ),
        # The SDK's tool runner continues a server-kept thread; dropped, the history is lost.
        (WEATHER, {"thread": {"type": "continue", "previous_message_id": "msg_1"}}, "thread"),
    ],
)
def test_malformed_requests_are_400(
    fast_qwen3: FastApp, messages: list[Any], extra: dict[str, Any], message_part: str
) -> None:
    calls = len(fast_qwen3.engine.calls)
    body = {"model": "qwen3-tiny", "max_tokens": 8, "messages": messages, **extra}
    response = fast_qwen3.client.post("/v1/messages", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message_part in error["message"]
    assert error["param"] and error["param"].split(".")[0] in error["message"], error
    assert len(fast_qwen3.engine.calls) == calls


@pytest.mark.parametrize(
    ("messages", "extra"),
    [
        # A schema without ``type`` is an object's (vLLM's default); tool_choice auto forces
        # nothing, so it needs no tools.
        (WEATHER, {"tools": [{"name": "f", "input_schema": {"properties": {}}}]}),
        (WEATHER, {"tool_choice": {"type": "auto"}}),
        (WEATHER, {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "none"}}),
        # Consecutive user messages are one turn to Anthropic: results may be in either.
        ([*CALLED, {"role": "user", "content": "Here:"}, TOOL_RESULT], {"tools": ANTHROPIC_TOOLS}),
        # A final assistant message's calls (a prefill) need no answer.
        (CALLED, {"tools": ANTHROPIC_TOOLS}),
    ],
)
def test_valid_tool_bodies_are_answered(
    fast_qwen3: FastApp, messages: list[Any], extra: dict[str, Any]
) -> None:
    script(fast_qwen3, "Sunny.")
    body = {"model": "qwen3-tiny", "max_tokens": 8, "messages": messages, **extra}
    response = fast_qwen3.client.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text


def test_sdk_sees_errors(fast_qwen3: FastApp) -> None:
    client = anthropic_client(fast_qwen3)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=8, messages=WEATHER)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(
            base_url="http://testserver",
            api_key="wrong",
            http_client=fast_qwen3.client,
            max_retries=0,
        ).messages.create(model="qwen3-tiny", max_tokens=8, messages=WEATHER)
