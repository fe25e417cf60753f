"""The per-choice decoder on real Qwen3 token streams: any chunking equals one piece, and the
stop token, stop strings and special tokens follow one rule."""

from __future__ import annotations

import itertools

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_logprob_tokens import load
from tests.test_parsers import FRAGMENTS, PARSER_SETS, STREAM_TEXTS, parse, same
from tokenwire.parsers import AssistantMessage, get_reasoning_parser, get_tool_parser
from tokenwire.pipeline.decoder import ChoiceDecoder, ChoiceState, DecodeOptions, Parsing
from tokenwire.text.token_text import LogprobInput, TokenTextDecoder, resolve_logprob_tokens
from tokenwire.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    return load("qwen3-tiny")


def parsing(reasoning: str | None, tools: str | None, pit: bool) -> Parsing:
    return Parsing(
        reasoning_parser=get_reasoning_parser(reasoning) if reasoning else None,
        tool_parser=get_tool_parser(tools) if tools else None,
        prompt_in_think=pit,
    )


def start(
    tokenizer: Tokenizer,
    how: Parsing | None = None,
    options: DecodeOptions | None = None,
    prompt: list[int] | None = None,
) -> ChoiceDecoder:
    return ChoiceDecoder.start(
        TokenTextDecoder(tokenizer),
        frozenset({tokenizer.eos_token_id}),
        options or DecodeOptions(),
        how or Parsing(),
        prompt,
    )


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
    decoder = start(tokenizer, parsing(reasoning, tools, pit))
    content, reasoning_text, calls = [], [], []
    bounds = [0, *sorted(set(cuts) - {0, len(ids)}), len(ids)]
    for begin, end in itertools.pairwise(bounds):
        finished = end == len(ids)
        step = decoder.step(ids[begin:end], finish_reason="length" if finished else None)
        if serialise:
            decoder.state = ChoiceState.from_json(
                orjson.loads(orjson.dumps(decoder.state.to_json()))
            )
        content.append(step.message.content or "")
        reasoning_text.append(step.message.reasoning_content or "")
        for item in step.message.tool_calls:
            assert item.index == len(calls)
            calls.append(item.call)
    return AssistantMessage("".join(content) or None, "".join(reasoning_text) or None, calls)


@pytest.mark.parametrize(("reasoning", "tools", "pit"), PARSER_SETS)
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_token_by_token_equals_non_streaming(
    qwen: Tokenizer, text: str, reasoning: str | None, tools: str | None, pit: bool
) -> None:
    ids = qwen.encode(text, add_special_tokens=False)
    expected = non_streaming(qwen, ids, reasoning, tools, pit)
    same(streamed(qwen, ids, list(range(len(ids))), reasoning, tools, pit), expected)


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


def test_choice_state_is_small(qwen: Tokenizer) -> None:
    ids = qwen.encode(
        "<think>" + "long reasoning " * 200 + "</think>done", add_special_tokens=False
    )
    decoder = start(qwen, parsing("qwen3", "hermes", False))
    for token_id in ids:
        decoder.step([token_id], finish_reason=None)
        # Held text is at most a partial tag.
        assert len(orjson.dumps(decoder.state.to_json())) < 300
    assert decoder.state.tokens == len(ids)


@pytest.mark.parametrize(
    "data", [None, [], "x", {}, {"calls": -1}, {"calls": 0, "offset": 0, "n": 0}]
)  # fmt: skip
def test_bad_choice_states_are_value_errors(data: object) -> None:
    with pytest.raises(ValueError):
        ChoiceState.from_json(data)


def test_finished_choice_refuses_more(qwen: Tokenizer) -> None:
    decoder = start(qwen)
    decoder.step([1], finish_reason="length")
    with pytest.raises(ValueError, match="finished"):
        decoder.step([1], finish_reason="length")


def test_stream_logprobs_and_stop_token(qwen: Tokenizer) -> None:
    """Logprob JSON per chunk equals the one-pass resolution; the stop token is not content."""
    ids = [*qwen.encode("<think>x</think>Hi 龘🫠!", add_special_tokens=False), qwen.eos_token_id]
    entries = [(t, -0.5, [(t, -0.5), (9284, -2.0)]) for t in ids]
    expected = [r.to_json() for r in resolve_logprob_tokens(qwen, ids, entries)]
    decoder = start(qwen, parsing("qwen3", "hermes", False))
    got, content = [], ""
    for i, token_id in enumerate(ids):
        finished = i == len(ids) - 1
        step = decoder.step(
            [token_id],
            finish_reason="stop" if finished else None,
            logprobs=LogprobInput.from_entries(entries[i : i + 1]),
        )
        assert isinstance(step.logprobs, bytes)
        got.extend(orjson.loads(step.logprobs)["content"])
        content += step.message.content or ""
    assert got == expected
    assert content == "Hi 龘🫠!"


# -- stop token, stop strings, special tokens --------------------------------------------------


def test_stop_reason_decides_which_token_is_the_stop_token(qwen: Tokenizer) -> None:
    im_end = qwen.eos_token_id
    ids = [*qwen.encode("Hi", add_special_tokens=False), im_end]
    keep_special = DecodeOptions(skip_special_tokens=False)
    # eos (stop_reason None) and a stop token id: dropped from the text.
    assert start(qwen, options=keep_special).step(ids, finish_reason="stop").text == "Hi"
    by_id = start(qwen, options=keep_special).step(ids, finish_reason="stop", stop_reason=im_end)
    assert by_id.text == "Hi"
    # Ended by length or by a stop string: the last token is text like any other.
    assert start(qwen, options=keep_special).step(ids, finish_reason="length").text == (
        "Hi<|im_end|>"
    )


@pytest.mark.parametrize(
    ("include", "expected"), [(False, "The c"), (True, "The ca")]
)  # fmt: skip
def test_stop_string_cut_inside_a_token(qwen: Tokenizer, include: bool, expected: str) -> None:
    ids = qwen.encode("The capital of France", add_special_tokens=False)
    options = DecodeOptions(stop_strings=("a",), include_stop_str_in_output=include)
    whole = start(qwen, options=options).step(ids, finish_reason="stop", stop_reason="a")
    assert whole.text == expected
    decoder = start(qwen, options=options)
    pieces = [
        decoder.step([t], finish_reason="stop" if i == len(ids) - 1 else None).text
        for i, t in enumerate(ids)
    ]
    assert "".join(pieces) == expected


def test_streaming_holds_back_a_possible_stop_string(qwen: Tokenizer) -> None:
    ids = qwen.encode("one two three", add_special_tokens=False)
    decoder = start(qwen, options=DecodeOptions(stop_strings=("two three four",)))
    emitted = [decoder.step([t], finish_reason=None).text for t in ids]
    # Up to 13 characters may begin the stop string: nothing is released early.
    assert "".join(emitted) == ""
    assert decoder.step([], finish_reason="length").text == "one two three"


def test_prompt_split_character_decodes_once(qwen: Tokenizer) -> None:
    """'龘' is [82912, 246]: its first byte piece ends the prompt, the rest opens the output."""
    decoder = start(qwen, prompt=[82912])
    step = decoder.step([246, *qwen.encode("!", add_special_tokens=False)], finish_reason="length")
    assert step.text == "龘!"
