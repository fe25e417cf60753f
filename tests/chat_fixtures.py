"""Conversations and tools shared by the template, tokenize and render tests."""

from __future__ import annotations

import copy
from typing import Any

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]

SIMPLE = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
MULTI_TURN = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi there! 你好 🦩"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke about 龘."},
]
TOOL_TURNS = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Tokyo"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "22 C, rain"},
    {"role": "assistant", "content": "Paris is sunny; Tokyo is rainy."},
    {"role": "user", "content": "Thanks. And Berlin?"},
]
ENDS_WITH_ASSISTANT = [
    {"role": "user", "content": "Write a haiku."},
    {"role": "assistant", "content": "Autumn moonlight"},
]

CONVERSATIONS = {
    "simple": SIMPLE,
    "multi_turn": MULTI_TURN,
    "tool_turns": TOOL_TURNS,
    "ends_with_assistant": ENDS_WITH_ASSISTANT,
}


def with_string_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The OpenAI wire form: tool-call arguments as JSON strings (the server parses them)."""
    import json

    wire = copy.deepcopy(messages)
    for message in wire:
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return wire
