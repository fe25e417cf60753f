"""Reasoning and tool-call parsers, and streaming == non-streaming on real Qwen3 token streams."""

from __future__ import annotations

import itertools
import json
import re

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_logprob_tokens import load
from tokenwire.parsers import (
    REASONING_PARSER_NAMES,
    TOOL_PARSER_NAMES,
    AssistantMessage,
    advance_text,
    build_assistant_message,
    get_reasoning_parser,
    get_tool_parser,
    new_parse_state,
    prompt_ends_in_think,
)
from tokenwire.text.incremental import StreamingDerenderState, advance, start_stream
from tokenwire.text.token_text import LogprobInput, resolve_logprob_tokens
from tokenwire.text.tokenizer import Tokenizer

CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n'
    "</tool_call>"
)
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    return load("qwen3-tiny")


def parse(
    text: str,
    reasoning: str | None = "qwen3",
    tools: str | None = "hermes",
    *,
    prompt_in_think: bool = False,
    tools_enabled: bool = True,
) -> AssistantMessage:
    return build_assistant_message(
        text,
        reasoning_parser=reasoning,
        tool_parser=tools,
        tools_enabled=tools_enabled,
        prompt_in_think=prompt_in_think,
    )


def calls_of(message: AssistantMessage) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in message.tool_calls]


# -- registry --------------------------------------------------------------------------------


def test_registry_names_and_errors() -> None:
    assert REASONING_PARSER_NAMES == ("deepseek_r1", "qwen3")
    assert TOOL_PARSER_NAMES == ("hermes", "llama3_json")
    for name in REASONING_PARSER_NAMES:
        assert get_reasoning_parser(name).name == name
    for name in TOOL_PARSER_NAMES:
        assert get_tool_parser(name).name == name
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("nope")
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_tool_parser("nope")


# -- reasoning -------------------------------------------------------------------------------


@pytest.mark.parametrize("parser", REASONING_PARSER_NAMES)
@pytest.mark.parametrize(
    ("text", "prompt_in_think", "reasoning", "content"),
    [
        ("<think>\nstep\n</think>\n\nAnswer.", False, "\nstep\n", "\n\nAnswer."),
        ("  \n<think>step</think>Answer.", False, "step", "Answer."),  # whitespace before the tag
        ("step\n</think>\n\nAnswer.", True, "step\n", "\n\nAnswer."),  # <think> in the prompt
        ("<think>\ntruncated reasoning", False, "\ntruncated reasoning", None),
        ("truncated reasoning", True, "truncated reasoning", None),
        ("Plain answer.", False, None, "Plain answer."),  # enable_thinking=false: no tags
        ("<think></think>Answer.", False, None, "Answer."),  # empty reasoning is None
        ("<think>only</think>", False, "only", None),  # nothing after: content None
        ("<think>a</think>b</think>c", False, "a", "b</think>c"),  # first close wins
        ("", False, None, None),
        ("", True, None, None),
    ],
)
def test_reasoning_split(
    parser: str, text: str, prompt_in_think: bool, reasoning: str | None, content: str | None
) -> None:
    message = parse(text, parser, None, prompt_in_think=prompt_in_think)
    assert (message.reasoning_content, message.content) == (reasoning, content)


@pytest.mark.parametrize(
    ("prompt", "inside"),
    [
        ("<|im_start|>assistant\n<think>\n", True),  # R1 / Qwen3.5 templates
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # enable_thinking=false
        ("<|im_start|>assistant\n", False),
        ("<think>old</think> ... <|im_start|>assistant\n<think>", True),
    ],
)
def test_prompt_ends_in_think(prompt: str, inside: bool) -> None:
    assert prompt_ends_in_think(prompt) is inside


def test_close_without_open_differs_per_parser() -> None:
    text = "thinking...\n</think>\n\nAnswer."
    # deepseek_r1: the template put <think> in the prompt; vLLM reads this as reasoning.
    r1 = parse(text, "deepseek_r1", None)
    assert (r1.reasoning_content, r1.content) == ("thinking...\n", "\n\nAnswer.")
    # qwen3: no open block anywhere, so it is content (pass prompt_in_think when it is open).
    q = parse(text, "qwen3", None)
    assert (q.reasoning_content, q.content) == (None, text)
    # deepseek_r1 without any tag: content.
    assert parse("Answer.", "deepseek_r1", None).content == "Answer."


def test_text_before_think_tag_is_content() -> None:
    message = parse("Sure.<think>x</think>y", "qwen3", None)
    assert (message.reasoning_content, message.content) == (None, "Sure.<think>x</think>y")


def test_qwen3_tool_call_ends_open_reasoning() -> None:
    text = f"<think>\nI should check the weather.\n{CALL}"
    message = parse(text, "qwen3")
    assert message.reasoning_content == "\nI should check the weather.\n"
    assert calls_of(message) == [("get_weather", {"city": "Paris", "unit": "°C"})]
    assert message.content is None
    # A mere mention of the tag is not a call.
    mention = parse("<think>the <tool_call> tag is used for calls</think>ok", "qwen3")
    assert mention.reasoning_content == "the <tool_call> tag is used for calls"
    assert mention.content == "ok"
    # deepseek_r1 keeps it in the (truncated) reasoning.
    r1 = parse(text, "deepseek_r1")
    assert r1.reasoning_content == text[len("<think>") :] and not r1.tool_calls


def test_no_reasoning_parser_keeps_tags() -> None:
    text = "<think>x</think>y"
    assert parse(text, None, None).content == text


# -- hermes ----------------------------------------------------------------------------------


def test_hermes_after_think_block() -> None:
    message = parse(f"<think>\nweather?\n</think>\n\n{CALL}")
    assert message.reasoning_content == "\nweather?\n"
    assert message.content is None  # the "\n\n" before the call is dropped
    assert calls_of(message) == [("get_weather", {"city": "Paris", "unit": "°C"})]
    call = message.tool_calls[0]
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id)
    assert call.to_json()["type"] == "function"
    assert call.arguments == '{"city": "Paris", "unit": "°C"}'  # json.dumps, non-ASCII kept


def test_hermes_without_think_block_and_several_calls() -> None:
    message = parse(f"Let me check.\n{CALL}\n{CALL2}", "qwen3")
    assert message.content == "Let me check.\n\n"
    assert [name for name, _ in calls_of(message)] == ["get_weather", "get_time"]
    bare = parse(f"{CALL}{CALL2}", None)
    assert bare.content is None and len(bare.tool_calls) == 2


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f"}</tool_call>',  # no arguments
        '<tool_call>["f", {}]</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        "<tool_call>" + "[" * 50_000 + "</tool_call>",  # deep nesting: no RecursionError
        '<tool_call>{"name": "f", "arguments": {"x": 1}',  # unclosed and incomplete
    ],
)
def test_hermes_malformed_block_stays_content(block: str) -> None:
    message = parse(f"Hi {block}", None)
    assert message.content == f"Hi {block}"
    assert message.tool_calls == []


def test_hermes_malformed_block_next_to_a_valid_one() -> None:
    message = parse(f"{CALL} <tool_call>oops</tool_call>", None)
    assert calls_of(message) == [("get_weather", {"city": "Paris", "unit": "°C"})]
    assert message.content == " <tool_call>oops</tool_call>"


def test_hermes_unclosed_final_block_is_a_call() -> None:
    message = parse('<tool_call>{"name": "f", "parameters": {"a": [1, 2]}}', None)
    assert calls_of(message) == [("f", {"a": [1, 2]})]


def test_hermes_string_arguments() -> None:
    kept = parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None)
    assert kept.tool_calls[0].arguments == '{"a": 1}'
    encoded = parse('<tool_call>{"name": "f", "arguments": "plain"}</tool_call>', None)
    assert encoded.tool_calls[0].arguments == '"plain"'


def test_tools_disabled_or_no_parser_leaves_text() -> None:
    text = f"<think>x</think>{CALL}"
    assert parse(text, tools_enabled=False).content == CALL
    assert parse(text, tools=None).content == CALL


def test_whitespace_content_kept_without_calls() -> None:
    assert parse("<think>x</think>\n\n").content == "\n\n"
    assert parse(f"\n{CALL}\nDone.", None).content == "\n\nDone."


# -- llama3_json -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "calls", "content"),
    [
        ('{"name": "f", "parameters": {"x": 1}}', [("f", {"x": 1})], None),
        ('<|python_tag|>{"name": "f", "arguments": {"x": "é"}}', [("f", {"x": "é"})], None),
        (
            ' {"name": "f", "parameters": {}}; {"name": "g", "parameters": {"y": [1]}};',
            [("f", {}), ("g", {"y": [1]})],
            None,
        ),
        (
            'I will call it.<|python_tag|>{"name": "f", "parameters": {}}',
            [("f", {})],
            "I will call it.",
        ),
        (
            '{"name": "f", "parameters": {}} and more',
            [],
            '{"name": "f", "parameters": {}} and more',
        ),
        ('{"city": "Paris"}', [], '{"city": "Paris"}'),  # JSON answer, not a call
        ('{"name": "f", "parameters": {', [], '{"name": "f", "parameters": {'),
        ("Just text {with braces}", [], "Just text {with braces}"),
    ],
)
def test_llama3_json(text: str, calls: list, content: str | None) -> None:
    message = parse(text, None, "llama3_json")
    assert calls_of(message) == calls
    assert message.content == content


# -- streaming == non-streaming --------------------------------------------------------------

STREAM_TEXTS = [
    "A plain answer with 龘, 🦩 and 🫠 in it.",
    "<think>\nLet me think about 龘🫠.\n</think>\n\nThe answer is 42.",
    "Reasoning that never ends because the output was cut",
    f"<think>\nweather?\n</think>\n\n{CALL}",
    f"<think>\nI should call.\n{CALL}\n{CALL2}",
    f"Sure.\n{CALL}\n<tool_call>{{broken</tool_call>\nbye",
    '<think>the <tool_call> tag</think>\n\n<tool_call>{"name": "f", "arguments": {}}',
    "  <thi not a tag </think> </tool_ca <tool",
    '{"name": "f", "parameters": {"x": "🫠"}}; {"name": "g", "parameters": {}}',
]
PARSER_SETS = [
    ("qwen3", "hermes", False),
    ("qwen3", "hermes", True),
    ("deepseek_r1", "hermes", False),
    ("deepseek_r1", None, True),
    (None, "llama3_json", False),
    ("qwen3", "llama3_json", True),
]


def non_streaming(
    tokenizer: Tokenizer, ids: list[int], reasoning: str | None, tools: str | None, pit: bool
) -> AssistantMessage:
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return parse(text, reasoning, tools, prompt_in_think=pit)


def streamed(
    tokenizer: Tokenizer,
    ids: list[int],
    cuts: list[int],
    reasoning: str | None,
    tools: str | None,
    pit: bool,
    *,
    serialise: bool = True,
) -> AssistantMessage:
    """Feed ``ids`` in chunks ending at ``cuts``; join the deltas."""
    state = start_stream(tokenizer, prompt_in_think=pit)
    content, reasoning_text, calls = [], [], []
    bounds = [0, *sorted(set(cuts) - {0, len(ids)}), len(ids)]
    for start, end in itertools.pairwise(bounds):
        finished = end == len(ids)
        delta, state = advance(
            tokenizer,
            state,
            ids[start:end],
            finished=finished,
            reasoning_parser=reasoning,
            tool_parser=tools,
            tools_enabled=True,
        )
        if serialise:
            state = StreamingDerenderState.loads(state.dumps())
        content.append(delta.message.content or "")
        reasoning_text.append(delta.message.reasoning_content or "")
        for item in delta.message.tool_calls:
            assert item.index == len(calls)
            calls.append(item.call)
    return AssistantMessage("".join(content) or None, "".join(reasoning_text) or None, calls)


def same(a: AssistantMessage, b: AssistantMessage) -> None:
    assert (a.content, a.reasoning_content) == (b.content, b.reasoning_content)
    assert [(c.name, c.arguments) for c in a.tool_calls] == [
        (c.name, c.arguments) for c in b.tool_calls
    ]


@pytest.mark.parametrize(("reasoning", "tools", "pit"), PARSER_SETS)
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_token_by_token_equals_non_streaming(
    qwen: Tokenizer, text: str, reasoning: str | None, tools: str | None, pit: bool
) -> None:
    ids = qwen.encode(text, add_special_tokens=False)
    expected = non_streaming(qwen, ids, reasoning, tools, pit)
    same(streamed(qwen, ids, list(range(len(ids))), reasoning, tools, pit), expected)


FRAGMENTS = st.sampled_from(
    [
        "<think>", "</think>", "<tool_call>", "</tool_call>", "\n", "\n\n", " ", "  ",
        '{"name": "f", "arguments": {"a": 1}}', '{"name": "g", "parameters": {}}', ";",
        "<|python_tag|>", "<", "</", "<tool", "hello", "龘", "🫠", "🦩 ok", "{", "}", '"',
        "<function=f>", "plain words.",
    ]
)  # fmt: skip


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    parts=st.lists(FRAGMENTS, max_size=14),
    parsers=st.sampled_from(PARSER_SETS),
    data=st.data(),
)
def test_any_chunking_equals_non_streaming(
    qwen: Tokenizer, parts: list[str], parsers: tuple, data: st.DataObject
) -> None:
    reasoning, tools, pit = parsers
    ids = qwen.encode("".join(parts), add_special_tokens=False)
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=6))
    expected = non_streaming(qwen, ids, reasoning, tools, pit)
    same(streamed(qwen, ids, cuts, reasoning, tools, pit, serialise=False), expected)


@settings(max_examples=100, deadline=None)
@given(
    parts=st.lists(FRAGMENTS, max_size=14),
    parsers=st.sampled_from(PARSER_SETS),
    data=st.data(),
)
def test_text_level_chunking_equals_one_piece(
    parts: list[str], parsers: tuple, data: st.DataObject
) -> None:
    """The parsers alone, cut at any character (not only token boundaries)."""
    reasoning, tools, pit = parsers
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    state = new_parse_state(prompt_in_think=pit)
    content, reasoning_text, calls = [], [], []
    bounds = [0, *cuts, len(text)]
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        delta = advance_text(
            state, text[start:end], finished=i == len(bounds) - 2,
            reasoning_parser=reasoning, tool_parser=tools, tools_enabled=True,
        )  # fmt: skip
        content.append(delta.content or "")
        reasoning_text.append(delta.reasoning_content or "")
        calls.extend(item.call for item in delta.tool_calls)
    joined = AssistantMessage("".join(content) or None, "".join(reasoning_text) or None, calls)
    same(joined, parse(text, reasoning, tools, prompt_in_think=pit))


def test_stream_state_is_small_and_opaque(qwen: Tokenizer) -> None:
    ids = qwen.encode(
        "<think>" + "long reasoning " * 200 + "</think>done", add_special_tokens=False
    )
    state = start_stream(qwen)
    for token_id in ids:
        _, state = advance(
            qwen, state, [token_id], finished=False, reasoning_parser="qwen3",
            tool_parser="hermes", tools_enabled=True,
        )  # fmt: skip
        assert len(state.dumps()) < 300  # held text is at most a partial tag
    assert state.tokens == len(ids)


@pytest.mark.parametrize(
    "blob", ["", "not base64!", "eyJ2IjoyfQ", "W10", "eyJ2IjoxLCJuIjotMX0"]
)  # fmt: skip
def test_bad_state_strings_are_value_errors(blob: str) -> None:
    with pytest.raises(ValueError):
        StreamingDerenderState.loads(blob)


def test_finished_stream_refuses_more(qwen: Tokenizer) -> None:
    _, state = advance(
        qwen, start_stream(qwen), [1], finished=True, reasoning_parser=None,
        tool_parser=None, tools_enabled=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="finished"):
        advance(qwen, state, [1], finished=True, reasoning_parser=None, tool_parser=None,
                tools_enabled=False)  # fmt: skip


def test_stream_logprobs_and_stop_token(qwen: Tokenizer) -> None:
    """Logprob JSON per chunk equals the one-pass resolution; the stop token is not content."""
    ids = [*qwen.encode("<think>x</think>Hi 龘🫠!", add_special_tokens=False), qwen.eos_token_id]
    entries = [(t, -0.5, [(t, -0.5), (9284, -2.0)]) for t in ids]
    expected = [r.to_json() for r in resolve_logprob_tokens(qwen, ids, entries)]
    state = start_stream(qwen)
    got, content = [], ""
    for i, token_id in enumerate(ids):
        finished = i == len(ids) - 1
        delta, state = advance(
            qwen,
            state,
            [token_id],
            finished=finished,
            reasoning_parser="qwen3",
            tool_parser="hermes",
            tools_enabled=True,
            logprobs=LogprobInput.from_entries(entries[i : i + 1]),
            drop_stop_token=finished,
        )
        assert delta.logprobs_json is not None
        got.extend(orjson.loads(delta.logprobs_json)["content"])
        content += delta.message.content or ""
    assert got == expected
    assert content == "Hi 龘🫠!"
