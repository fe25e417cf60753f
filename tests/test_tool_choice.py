"""Forced tool choice on the real server (qwen3-tiny's random weights, the hermes parser),
through the openai and anthropic SDKs: every reply of a forcing request is a parsed call of an
offered tool whose arguments validate, as many calls as the request allows. Before the grammar,
the same requests gave a call in 8-9 replies of 12 and two or more calls in 4-8 of 12 with
parallel calls off."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema_rs
import openai
import pytest

from tests.conftest import API_KEY, Server

FORECAST = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["unit", "days"],
    "additionalProperties": False,
}
SUM = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}
SCHEMAS = {"forecast": FORECAST, "sum": SUM}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
MESSAGES: list[Any] = [{"role": "user", "content": "What will the weather be?"}]
N = 12
# Random weights think for ever once they open <think>: the prompt closes it.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def client(qwen3_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{qwen3_server.url}/v1", api_key=API_KEY, max_retries=0)


def check_calls(name: str, arguments: str | dict[str, Any], allowed: set[str]) -> None:
    assert name in allowed
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema_rs.validate(SCHEMAS[name], args)


def chat_choices(client: openai.OpenAI, **fields: Any) -> list[Any]:
    answer = client.chat.completions.create(
        model="qwen3-tiny",
        messages=MESSAGES,
        tools=TOOLS,
        n=N,
        seed=11,
        temperature=1.0,
        max_tokens=256,
        extra_body=NO_THINKING,
        **fields,
    )
    return answer.choices


def test_chat_required_named_and_single(client: openai.OpenAI) -> None:
    counts = []
    for choice in chat_choices(client, tool_choice="required"):
        assert choice.finish_reason == "tool_calls", choice.message.content
        for call in choice.message.tool_calls or ():
            check_calls(call.function.name, call.function.arguments, set(SCHEMAS))
        counts.append(len(choice.message.tool_calls or ()))
    assert min(counts) >= 1
    named = {"type": "function", "function": {"name": "sum"}}
    for choice in chat_choices(client, tool_choice=named, parallel_tool_calls=False):
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == "tool_calls" and len(calls) == 1, choice.message.content
        check_calls(calls[0].function.name, calls[0].function.arguments, {"sum"})


def test_anthropic_any_without_parallel_calls(qwen3_server: Server) -> None:
    client = anthropic.Anthropic(base_url=qwen3_server.url, api_key=API_KEY, max_retries=0)
    tools: list[Any] = [
        {"name": name, "description": name, "input_schema": schema}
        for name, schema in SCHEMAS.items()
    ]
    for _ in range(4):
        message = client.messages.create(
            model="qwen3-tiny",
            max_tokens=256,
            messages=MESSAGES,
            tools=tools,
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            thinking={"type": "disabled"},
        )
        uses = [block for block in message.content if block.type == "tool_use"]
        assert message.stop_reason == "tool_use" and len(uses) == 1, message.content
        check_calls(uses[0].name, uses[0].input, set(SCHEMAS))  # type: ignore[arg-type]
