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
