"""/v1/responses over the fake engine through the real ``openai`` SDK's
``client.responses.create``, streaming and not: reasoning, message and function_call items from
Qwen3's parsers, incomplete answers, function call outputs fed back, render, and malformed input
refused with a 400."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.chat_fixtures import TOOLS
from tests.conftest import API_KEY
from tests.fast_app import FastApp
from tests.test_fast_anthropic import IM_END, THINK_AND_CALL, named_events, script
from tokenwire.protocol.common import MAX_TOOLS

RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
WEATHER = "What is the weather in Paris?"


def openai_client(fast: FastApp) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key=API_KEY, http_client=fast.client, max_retries=0
    )


def test_response_with_reasoning_and_function_call(fast_qwen3: FastApp) -> None:
    ids = script(fast_qwen3, THINK_AND_CALL)
    client = openai_client(fast_qwen3)
    response = client.responses.create(
        model="qwen3-tiny", input=WEATHER, tools=RESPONSES_TOOLS, instructions="Be brief."
    )
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.output[0].content[0].text == "\nThe user wants the weather.\n"
    call = response.output[1]
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    assert response.status == "completed" and response.store is False
    assert response.usage.output_tokens == len(ids)
    think_close = fast_qwen3.tokenize("</think>")
    assert response.usage.output_tokens_details.reasoning_tokens == ids.index(think_close[0]) + 1
    prompt = fast_qwen3.engine.calls[-1].prompt_token_ids
    assert response.usage.input_tokens == len(prompt)


def test_stream_matches_whole(fast_qwen3: FastApp) -> None:
    script(fast_qwen3, "<think>\nHmm.\n</think>\n\nIt is sunny.")
    client = openai_client(fast_qwen3)
    whole = client.responses.create(model="qwen3-tiny", input=WEATHER)
    with client.responses.stream(model="qwen3-tiny", input=WEATHER) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_response()
    assert events[:2] == ["response.created", "response.in_progress"]
    assert events[-1] == "response.completed"
    assert "response.reasoning_text.delta" in events and "response.output_text.delta" in events
    # The text after </think> as the chat route gives it (Qwen3's parser keeps the newlines).
    assert final.output_text == whole.output_text == "\n\nIt is sunny."
    assert [item.type for item in final.output] == ["reasoning", "message"]
    created = client.responses.create(model="qwen3-tiny", input=WEATHER, stream=True)
    numbers = [event.sequence_number for event in created]
    assert numbers == list(range(len(numbers)))


def test_stream_framing_ends_with_done(fast_qwen3: FastApp) -> None:
    script(fast_qwen3, "Paris is nice.")
    events = named_events(fast_qwen3, "/v1/responses", {"model": "qwen3-tiny", "input": WEATHER})
    assert events[0] == "response.created" and events[-1] == "response.completed"


def test_function_call_stream_and_incomplete(fast_qwen3: FastApp) -> None:
    script(fast_qwen3, THINK_AND_CALL)
    client = openai_client(fast_qwen3)
    with client.responses.stream(
        model="qwen3-tiny", input=WEATHER, tools=RESPONSES_TOOLS
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done[0].arguments) == {"city": "Paris", "unit": "celsius"}
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    short = client.responses.create(model="qwen3-tiny", input=WEATHER, max_output_tokens=2)
    assert short.status == "incomplete"
    assert short.incomplete_details.reason == "max_output_tokens"
    with client.responses.stream(model="qwen3-tiny", input=WEATHER, max_output_tokens=2) as cut:
        assert cut.get_final_response().status == "incomplete"


def test_history_renders_as_the_chat_route(fast_qwen3: FastApp) -> None:
    history: list[Any] = [
        {"role": "user", "content": WEATHER},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Weather."}],
        },
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city": "P"}',
        },
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "developer", "content": [{"type": "input_text", "text": "Thanks"}]},
    ]
    body = {"input": history, "tools": RESPONSES_TOOLS, "instructions": "Be brief."}
    rendered = fast_qwen3.client.post("/v1/responses/render", json=body)
    assert rendered.status_code == 200, rendered.text
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": WEATHER},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Weather.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "P"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "system", "content": [{"type": "text", "text": "Thanks"}]},
    ]
    expected = fast_qwen3.client.post(
        "/v1/chat/completions/render", json={"messages": chat, "tools": TOOLS}
    )
    assert rendered.json()["token_ids"] == expected.json()["token_ids"]


@pytest.mark.parametrize(
    ("body", "message_part"),
    [
        (
            {"input": [{"type": "function_call_output", "call_id": "x", "output": "1"}]},
            "no earlier function_call",
        ),
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input"),
        ({"input": WEATHER, "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": WEATHER, "conversation": "conv_1"}, "conversation"),
        ({"input": WEATHER, "conversation": {"id": "conv_1"}}, "conversation"),
        ({"input": WEATHER, "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": []}, "input"),
        ({"input": WEATHER, "text": {"format": {"type": "json_schema"}}}, "text.format"),
        # Echoed in the answer: a value it could not serialise was a 500 (found by fuzzing).
        ({"input": WEATHER, "metadata": {"a": -(2**65)}}, "metadata.a"),
        ({"input": WEATHER, "metadata": {str(i): "x" for i in range(17)}}, "metadata"),
        (
            {
                "input": WEATHER,
                "tools": [{"type": "function", "name": "f", "parameters": {"maximum": 2**70}}],
            },
            "64 bits",
        ),
        # A forcing tool choice without tools was dropped silently (text answered).
        ({"input": WEATHER, "tool_choice": "required"}, "offers no tools"),
        (
            {"input": WEATHER, "tool_choice": {"type": "function", "name": "get_weather"}},
            "offers no tools",
        ),
        (
            {"input": WEATHER, "tools": [*RESPONSES_TOOLS, RESPONSES_TOOLS[0]]},
            "tools: tool names must be unique: 'get_weather' is offered twice",
        ),
        (
            {
                "input": WEATHER,
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}],
            },
            "tools.0.parameters: a tool's schema must have type 'object'",
        ),
        # A stored prompt template was ignored: the answer came from a prompt without it.
        ({"input": WEATHER, "prompt": {"id": "pmpt_1"}}, "prompt is not supported"),
        # Accepted without effect, but only with values the API has (vLLM's 400s).
        ({"input": WEATHER, "reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"input": WEATHER, "reasoning": {"summary": "long"}}, "reasoning.summary"),
        ({"input": WEATHER, "truncation": "middle"}, "truncation"),
        ({"input": WEATHER, "include": ["message.logprobs"]}, "include.0"),
    ],
)
def test_malformed_requests_are_400(
    fast_qwen3: FastApp, body: dict[str, Any], message_part: str
) -> None:
    calls = len(fast_qwen3.engine.calls)
    response = fast_qwen3.client.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message_part in error["message"]
    assert error["param"] and error["param"].split(".")[0] in error["message"], error
    assert len(fast_qwen3.engine.calls) == calls
    assert IM_END  # the module's scripts end with Qwen3's end of turn


def test_sdk_fields_accepted_without_effect(fast_qwen3: FastApp) -> None:
    """What the SDK sends for the fields checked above stays a 200."""
    script(fast_qwen3, "Sunny.")
    response = openai_client(fast_qwen3).responses.create(
        model="qwen3-tiny",
        input=WEATHER,
        reasoning={"effort": "low", "summary": "auto"},
        truncation="auto",
        include=["reasoning.encrypted_content", "message.output_text.logprobs"],
        tools=[{"type": "function", "name": "f", "parameters": None, "strict": False}],
        tool_choice="auto",
        max_output_tokens=8,
    )
    assert response.output_text == "Sunny."
    # tool_choice auto forces nothing: no tools needed.
    script(fast_qwen3, "Sunny.")
    body = {"input": WEATHER, "tool_choice": "auto", "max_output_tokens": 8}
    assert fast_qwen3.client.post("/v1/responses", json=body).status_code == 200


@pytest.mark.parametrize("route", ["/v1/responses", "/v1/messages", "/v1/chat/completions"])
def test_too_many_tools_are_a_400_and_others_are_answered(fast_qwen3: FastApp, route: str) -> None:
    """Over MAX_TOOLS the list is refused before its tools are read (10,000 tools, 11 MB, held
    the event loop for up to 1.2 s); /health sent while it is handled is answered."""
    tool = RESPONSES_TOOLS[0]
    if route == "/v1/responses":
        tools: list[dict[str, Any]] = [{**tool, "name": f"f{i}"} for i in range(MAX_TOOLS + 1)]
        body: dict[str, Any] = {"input": WEATHER, "tools": tools}
    elif route == "/v1/messages":
        tools = [
            {"name": f"f{i}", "input_schema": tool["parameters"]} for i in range(MAX_TOOLS + 1)
        ]
        body = {"messages": [{"role": "user", "content": WEATHER}], "max_tokens": 8}
        body["tools"] = tools
    else:
        tools = [
            {"type": "function", "function": {"name": f"f{i}", "parameters": tool["parameters"]}}
            for i in range(MAX_TOOLS + 1)
        ]
        body = {"messages": [{"role": "user", "content": WEATHER}], "tools": tools}
    calls = len(fast_qwen3.engine.calls)
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(fast_qwen3.client.post, route, json=body)
        healthy = 0
        while not big.done() or not healthy:
            assert fast_qwen3.client.get("/health").status_code == 200
            healthy += 1
        response = big.result()
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools", error
    assert f"at most {MAX_TOOLS} tools" in error["message"]
    assert len(fast_qwen3.engine.calls) == calls
    # At the bound, the list is read (the prompt is then too long for this model: a 400 for it).
    body["tools"] = tools[:MAX_TOOLS]
    assert "tools" not in str(fast_qwen3.client.post(route, json=body).json()["error"]["param"])
