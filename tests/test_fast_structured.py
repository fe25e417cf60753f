"""Structured outputs over the fake engine (issue 30): every peer's field reaches the engine as
the compiled grammar of the same constraint (checked token by token on the Qwen3 vocabulary:
what a valid answer needs is allowed, what breaks it is not), equal constraints compile once,
and whatever cannot be enforced is a 400 naming the field before the engine sees the request:
never a 200 that ignored it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.fast_app import FastApp
from tokenwire.engine.base import Grammar

IM_END = 151645  # Qwen3's eos
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["city", "n"],
    "additionalProperties": False,
}
GOOD = '{"city": "Paris", "n": 3}'
HELLO = [{"role": "user", "content": "Hello"}]


def post(fast: FastApp, path: str, body: dict[str, Any], status: int = 200) -> Any:
    response = fast.client.post(path, json=body)
    assert response.status_code == status, response.text
    return response.json()


def accepts(fast: FastApp, grammar: Grammar | None, text: str) -> bool:
    """Whether ``grammar`` lets the ids of ``text`` be sampled one by one, then eos."""
    assert grammar is not None
    state = grammar.new_state()
    for token in fast.tokenize(text):
        if not state.allowed()[token]:
            return False
        state.accept(token)
    return bool(state.allowed()[IM_END])


def last_grammar(fast: FastApp) -> Grammar | None:
    return fast.engine.calls[-1].sampling.grammar


def scripted(fast: FastApp, text: str) -> None:
    """The fake engine answers ``text`` then eos (the script runs on the app's loop)."""
    ids = [*fast.tokenize(text), IM_END]
    fast.engine.script = lambda *_: ids


def chat(fast: FastApp, **fields: Any) -> Grammar | None:
    scripted(fast, GOOD)
    post(fast, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 32, **fields})
    return last_grammar(fast)


def test_chat_response_format_json_schema(fast_qwen3: FastApp) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    grammar = chat(fast_qwen3, response_format=fmt)
    assert accepts(fast_qwen3, grammar, GOOD)
    assert accepts(fast_qwen3, grammar, '{"city":"Rome","n":-12}')
    assert not accepts(fast_qwen3, grammar, '{"city": "Paris"}')  # n is required
    assert not accepts(fast_qwen3, grammar, '{"city": "Paris", "n": 3, "x": 1}')
    assert not accepts(fast_qwen3, grammar, "Sure! Here it is")
    # The same schema again: compiled once, the same grammar.
    assert chat(fast_qwen3, response_format=fmt) is grammar


def test_chat_json_object_text_and_vllm_fields(fast_qwen3: FastApp) -> None:
    grammar = chat(fast_qwen3, response_format={"type": "json_object"})
    assert accepts(fast_qwen3, grammar, '{"any": [1, 2]}')
    assert not accepts(fast_qwen3, grammar, "[1, 2]")
    assert chat(fast_qwen3, response_format={"type": "text"}) is None
    grammar = chat(fast_qwen3, guided_choice=["yes", "no"])
    assert accepts(fast_qwen3, grammar, "yes") and not accepts(fast_qwen3, grammar, "maybe")
    grammar = chat(fast_qwen3, guided_regex=r"\d{3}-[a-z]+")
    assert accepts(fast_qwen3, grammar, "123-abc") and not accepts(fast_qwen3, grammar, "12-abc")
    grammar = chat(fast_qwen3, guided_json=json.dumps(SCHEMA))
    assert accepts(fast_qwen3, grammar, GOOD)
    grammar = chat(fast_qwen3, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    assert accepts(fast_qwen3, grammar, '{"city":"Paris","n":3}')
    assert not accepts(fast_qwen3, grammar, GOOD)  # compact: no spaces
    grammar = chat(fast_qwen3, structured_outputs={"grammar": 'start: "a" "b"+'})
    assert accepts(fast_qwen3, grammar, "abbb") and not accepts(fast_qwen3, grammar, "ba")


def test_completions_take_response_format_too(fast_qwen3: FastApp) -> None:
    scripted(fast_qwen3, "no")
    body = {"prompt": "Answer:", "max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}}
    post(fast_qwen3, "/v1/completions", body)
    assert accepts(fast_qwen3, last_grammar(fast_qwen3), "no")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "grammar"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "response_format, guided_*",
        ),
        ({"guided_json": "{not json"}, "not valid JSON"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_json, guided_regex"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "exactly one"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag"),
        ({"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs.jsn"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format",
        ),
    ],
)
def test_chat_refuses_what_it_cannot_enforce(
    fast_qwen3: FastApp, fields: dict[str, Any], named: str
) -> None:
    before = len(fast_qwen3.engine.calls)
    body = {"messages": HELLO, "max_tokens": 8, **fields}
    error = post(fast_qwen3, "/v1/chat/completions", body, status=400)["error"]
    assert named in error["message"], error
    assert len(fast_qwen3.engine.calls) == before  # the engine never saw it


def test_an_engine_without_structured_outputs_refuses_them(fast_qwen3: FastApp) -> None:
    engine = fast_qwen3.engine
    features = engine.features
    engine.features = features - {"structured_outputs"}
    try:
        body = {"messages": HELLO, "max_tokens": 8, "response_format": {"type": "json_object"}}
        error = post(fast_qwen3, "/v1/chat/completions", body, status=400)["error"]
        assert "response_format" in error["message"] and "engine" in error["message"]
        # Free text still runs.
        engine.script = lambda *_: [IM_END]
        post(fast_qwen3, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 8})
    finally:
        engine.features = features


def test_render_then_generate_carries_the_constraint(fast_qwen3: FastApp) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    body = {"messages": HELLO, "max_tokens": 32, "response_format": fmt}
    rendered = post(fast_qwen3, "/v1/chat/completions/render", body)
    assert rendered["sampling_params"]["structured_outputs"] == {"json": SCHEMA}
    scripted(fast_qwen3, GOOD)
    post(fast_qwen3, "/inference/v1/generate", rendered)
    assert accepts(fast_qwen3, last_grammar(fast_qwen3), GOOD)


def generate(fast: FastApp, sampling: dict[str, Any], status: int = 200) -> Any:
    scripted(fast, "b")
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 8, **sampling}}
    return post(fast, "/inference/v1/generate", body, status)


def test_generate_structured_outputs_and_guided_decoding(fast_qwen3: FastApp) -> None:
    generate(fast_qwen3, {"structured_outputs": {"choice": ["a", "b"]}})
    grammar = last_grammar(fast_qwen3)
    assert accepts(fast_qwen3, grammar, "b") and not accepts(fast_qwen3, grammar, "c")
    generate(fast_qwen3, {"guided_decoding": {"regex": "[ab]+"}})
    assert accepts(fast_qwen3, last_grammar(fast_qwen3), "abba")
    generate(fast_qwen3, {"structured_outputs": {"json_object": True}})
    assert accepts(fast_qwen3, last_grammar(fast_qwen3), "{}")
    error = generate(fast_qwen3, {"structured_outputs": {"structural_tag": "{}"}}, 400)
    assert "structural_tag" in error["error"]["message"]
    both = {"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}}
    assert "not both" in generate(fast_qwen3, both, 400)["error"]["message"]


def test_sglang_json_schema_regex_ebnf(fast_qwen3: FastApp) -> None:
    def run(sampling: dict[str, Any], status: int = 200) -> Any:
        scripted(fast_qwen3, "b")
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8, **sampling}}
        return post(fast_qwen3, "/generate", body, status)

    run({"json_schema": json.dumps(SCHEMA)})
    assert accepts(fast_qwen3, last_grammar(fast_qwen3), GOOD)
    run({"regex": "x+y"})
    assert accepts(fast_qwen3, last_grammar(fast_qwen3), "xxy")
    run({"ebnf": 'start: "left" | "right"'})
    assert accepts(fast_qwen3, last_grammar(fast_qwen3), "right")
    error = run({"regex": "a", "ebnf": 'start: "a"'}, 400)["error"]
    assert "regex, ebnf" in error["message"]
    assert "structural_tag" in run({"structural_tag": "{}"}, 400)["error"]["message"]


def test_responses_text_format(fast_qwen3: FastApp) -> None:
    scripted(fast_qwen3, GOOD)
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
    body = {"model": "qwen3-tiny", "input": "Hello", "text": {"format": fmt}}
    answer = post(fast_qwen3, "/v1/responses", body)
    assert answer["text"]["format"] == fmt
    assert accepts(fast_qwen3, last_grammar(fast_qwen3), GOOD)
    bad = {**body, "text": {"format": {"type": "json_schema", "name": "x"}}}
    error = post(fast_qwen3, "/v1/responses", bad, 400)["error"]
    assert "text.format.schema" in error["message"]


def test_anthropic_output_format(fast_qwen3: FastApp) -> None:
    scripted(fast_qwen3, GOOD)
    body = {
        "model": "qwen3-tiny",
        "max_tokens": 32,
        "messages": HELLO,
        "output_format": {"type": "json_schema", "schema": SCHEMA},
    }
    answer = post(fast_qwen3, "/v1/messages", body)
    assert answer["content"][-1]["text"] == GOOD
    assert accepts(fast_qwen3, last_grammar(fast_qwen3), GOOD)
    config = {**body, "output_format": None, "output_config": {"format": body["output_format"]}}
    post(fast_qwen3, "/v1/messages", config)
    assert accepts(fast_qwen3, last_grammar(fast_qwen3), GOOD)
    bad = {**body, "output_format": {"type": "json_schema", "schema": {"type": "nope"}}}
    error = post(fast_qwen3, "/v1/messages", bad, 400)["error"]
    assert "output_format" in error["message"]


# Forced tool choice: a grammar over the hermes parser's call format (qwen3 template).
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER_TOOL, ADD_TOOL]
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TWO_CALLS = f"{WEATHER_CALL}\n{ADD_CALL}"
THOUGHT = "<think>\nThe user wants weather.\n</think>\n\n"


def forced(fast: FastApp, answer: str = WEATHER_CALL, **fields: Any) -> Any:
    scripted(fast, answer)
    body = {"messages": HELLO, "max_tokens": 64, "tools": TOOLS, **fields}
    return post(fast, "/v1/chat/completions", body)


def test_tool_choice_required_forces_calls_in_the_parsers_format(fast_qwen3: FastApp) -> None:
    answer = forced(fast_qwen3, tool_choice="required")
    grammar = last_grammar(fast_qwen3)
    for text in (WEATHER_CALL, TWO_CALLS, THOUGHT + ADD_CALL):
        assert accepts(fast_qwen3, grammar, text), text
    for text in ("Sure, calling it.", "", '{"name": "add", "arguments": {"a": 1, "b": 2}}'):
        assert not accepts(fast_qwen3, grammar, text), text
    assert not accepts(fast_qwen3, grammar, WEATHER_CALL.replace('"Paris"', "3"))  # schema
    assert not accepts(fast_qwen3, grammar, WEATHER_CALL.replace("get_weather", "rm_rf"))
    # The tags are their single tokens: the call cannot be spelled in pieces.
    state = grammar.new_state()  # type: ignore[union-attr]
    assert state.allowed().sum() == 2  # <tool_call> or <think>
    assert answer["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert answer["choices"][0]["finish_reason"] == "tool_calls"


def test_named_tool_and_parallel_calls_off(fast_qwen3: FastApp) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    forced(fast_qwen3, ADD_CALL, tool_choice=named)
    grammar = last_grammar(fast_qwen3)
    assert accepts(fast_qwen3, grammar, ADD_CALL) and accepts(
        fast_qwen3, grammar, f"{ADD_CALL}\n{ADD_CALL}"
    )
    assert not accepts(fast_qwen3, grammar, WEATHER_CALL)
    forced(fast_qwen3, tool_choice="required", parallel_tool_calls=False)
    grammar = last_grammar(fast_qwen3)
    assert accepts(fast_qwen3, grammar, WEATHER_CALL) and not accepts(
        fast_qwen3, grammar, TWO_CALLS
    )
    # auto with parallel calls off: text, or text then one call, never two calls.
    forced(fast_qwen3, "Hi!", tool_choice="auto", parallel_tool_calls=False)
    grammar = last_grammar(fast_qwen3)
    for text in ("Hi!", f"Let me check.\n{WEATHER_CALL}", WEATHER_CALL):
        assert accepts(fast_qwen3, grammar, text), text
    assert not accepts(fast_qwen3, grammar, TWO_CALLS)
    # auto with parallel calls on, and none: nothing to enforce.
    assert forced(fast_qwen3, "Hi!", tool_choice="auto") and last_grammar(fast_qwen3) is None
    assert forced(fast_qwen3, "Hi!", tool_choice="none") and last_grammar(fast_qwen3) is None


def test_anthropic_any_tool_and_disable_parallel(fast_qwen3: FastApp) -> None:
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    base = {"model": "qwen3-tiny", "max_tokens": 64, "messages": HELLO, "tools": tools}
    scripted(fast_qwen3, WEATHER_CALL)
    answer = post(fast_qwen3, "/v1/messages", {**base, "tool_choice": {"type": "any"}})
    assert answer["stop_reason"] == "tool_use"
    assert accepts(fast_qwen3, last_grammar(fast_qwen3), TWO_CALLS)
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    post(fast_qwen3, "/v1/messages", {**base, "tool_choice": choice})
    grammar = last_grammar(fast_qwen3)
    assert accepts(fast_qwen3, grammar, WEATHER_CALL)
    assert not accepts(fast_qwen3, grammar, f"{WEATHER_CALL}\n{WEATHER_CALL}")
    assert not accepts(fast_qwen3, grammar, ADD_CALL)


def test_responses_tool_choice_required(fast_qwen3: FastApp) -> None:
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    scripted(fast_qwen3, ADD_CALL)
    body = {"model": "qwen3-tiny", "input": "1+2?", "tools": tools, "tool_choice": "required"}
    answer = post(fast_qwen3, "/v1/responses", body)
    assert answer["output"][-1]["type"] == "function_call"
    assert accepts(fast_qwen3, last_grammar(fast_qwen3), ADD_CALL)
    assert not accepts(fast_qwen3, last_grammar(fast_qwen3), "3")


def test_tool_parameters_with_local_refs(fast_qwen3: FastApp) -> None:
    """A tool's ``$ref`` pointers name its own parameters schema: pydantic's ``$defs`` (every
    enum and nested model; pydantic-ai's output tool is one), draft-07 ``definitions`` and a
    recursive ``#``, each tool's own even where two use one name for different things. Nested
    in the grammar's document they once named its root: a 400, "Pointer '/$defs/Season' does
    not exist"."""
    season = {
        "$defs": {"Season": {"enum": ["spring", "summer"], "type": "string"}},
        "type": "object",
        "properties": {"season": {"$ref": "#/$defs/Season"}},
        "required": ["season"],
    }
    digit = {
        "definitions": {"Season": {"type": "integer"}},
        "type": "object",
        "properties": {"n": {"$ref": "#/definitions/Season"}, "next": {"$ref": "#"}},
        "required": ["n"],
    }
    tools = [
        {"type": "function", "function": {"name": name, "parameters": params}}
        for name, params in (("trip", season), ("count", digit))
    ]
    call = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'.format
    trip = call("trip", '{"season": "summer"}')
    scripted(fast_qwen3, trip)
    body = {"messages": HELLO, "max_tokens": 64, "tools": tools, "tool_choice": "required"}
    answer = post(fast_qwen3, "/v1/chat/completions", body)
    assert answer["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "trip"
    grammar = last_grammar(fast_qwen3)
    for text in (trip, call("count", '{"n": 1, "next": {"n": 2}}')):
        assert accepts(fast_qwen3, grammar, text), text
    for text in (call("trip", '{"season": "winter"}'), call("count", '{"n": "summer"}')):
        assert not accepts(fast_qwen3, grammar, text), text
    assert not accepts(fast_qwen3, grammar, call("count", '{"n": 1, "next": {"n": "x"}}'))


def test_reasoning_comes_before_the_constraint(fast_qwen3: FastApp) -> None:
    """With the qwen3 reasoning parser the model may think first (vLLM starts the grammar at
    the end of reasoning too); a prompt that closed the block leaves no reasoning."""
    grammar = chat(fast_qwen3, response_format={"type": "json_object"})
    assert accepts(fast_qwen3, grammar, "<think>\nhm\n</think>\n\n" + GOOD)
    assert accepts(fast_qwen3, grammar, GOOD)
    assert not accepts(fast_qwen3, grammar, "hm\n</think>\n\n" + GOOD)
    # enable_thinking false: the prompt ends with a closed block, reasoning is over.
    off = {"enable_thinking": False}
    grammar = chat(fast_qwen3, response_format={"type": "json_object"}, chat_template_kwargs=off)
    assert accepts(fast_qwen3, grammar, GOOD)
    assert not accepts(fast_qwen3, grammar, "<think>\nhm\n</think>\n\n" + GOOD)
    # A request's own grammar is taken as written.
    grammar = chat(fast_qwen3, structured_outputs={"grammar": 'start: "a"'})
    assert not accepts(fast_qwen3, grammar, "<think>\nhm\n</think>\n\na")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
        # A forcing choice without tools was dropped silently (vLLM refuses it too).
        ({"tools": None, "tool_choice": "required"}, "offers no tools"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice and response_format",
        ),
    ],
)
def test_tool_choice_refusals(fast_qwen3: FastApp, fields: dict[str, Any], named: str) -> None:
    before = len(fast_qwen3.engine.calls)
    body = {"messages": HELLO, "max_tokens": 8, "tools": TOOLS, **fields}
    error = post(fast_qwen3, "/v1/chat/completions", body, status=400)["error"]
    assert named in error["message"], error
    assert len(fast_qwen3.engine.calls) == before


def test_forcing_a_call_needs_a_tool_parser(fast_smollm2: FastApp) -> None:
    body = {"messages": HELLO, "max_tokens": 8, "tools": TOOLS, "tool_choice": "required"}
    error = post(fast_smollm2, "/v1/chat/completions", body, status=400)["error"]
    assert "--tool-call-parser" in error["message"]
