"""Logprob token texts and bytes: exact against the full decode, U+FFFD repaired from context."""

from __future__ import annotations

import functools
import itertools
import math

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenwire.assets import prepare
from tokenwire.protocol.logprobs_in import logprob_input
from tokenwire.text.logprob_json import (
    chat_logprobs_json,
    chat_logprobs_json_from,
    completion_logprobs_from,
)
from tokenwire.text.token_table import DecodeContext, TokenTable, token_table
from tokenwire.text.token_text import (
    LogprobInput,
    TokenTextDecoder,
    json_logprob,
    resolve_logprob_tokens,
)
from tokenwire.text.tokenizer import Tokenizer

TOKENIZERS = ("qwen3-tiny", "smollm2-135m-instruct")
TEXTS = (
    "龘",
    "🦩",
    "🫠",
    "Hello 龘🦩🫠 world",
    "你好，世界！这是一个测试。日本語のテキスト、カタカナ。한국어 문장.",
    "e\u0301 a\u0300\u0301\u0302 Z\u0351\u0352\u0353 ñ",  # combining marks
    "👩‍👩‍👧 🏳️‍🌈 👍🏽 🇫🇷 ☃️",  # ZWJ, modifiers, flags, variation selectors
    "def f(x):\n    return x ** 2  # λ → ∞\n\t\u00a0 \u3000end",
)


@functools.cache
def load(name: str) -> Tokenizer:
    """One tokenizer per session (shared with test_parsers)."""
    tokenizer = Tokenizer.load(prepare(name))
    token_table(tokenizer)
    return tokenizer


@functools.cache
def byte_pieces(name: str) -> list[int]:
    """Ids of single non-ASCII bytes: parts of characters, or invalid alone."""
    raw = token_table(load(name)).raw
    return [i for i, data in enumerate(raw) if len(data) == 1 and data[0] >= 0x80]


@functools.cache
def fallback_decoder(name: str) -> TokenTextDecoder:
    tokenizer = load(name)
    return TokenTextDecoder(tokenizer, TokenTable(tokenizer, force_fallback=True))


@pytest.fixture(scope="module", params=TOKENIZERS)
def name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def tokenizer(name: str) -> Tokenizer:
    return load(name)


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    return load("qwen3-tiny")


def entries_for(ids: list[int], alternatives: int = 0, vocab: int = 1000) -> list[tuple]:
    """The sampled token first, then ``alternatives`` arbitrary ids."""
    return [
        (
            token_id,
            -0.25,
            [
                (token_id, -0.25),
                *(((i * 31 + j * 7) % vocab, -1.0 - j) for j in range(alternatives)),
            ],
        )
        for i, token_id in enumerate(ids)
    ]


def check_exact(tokenizer: Tokenizer, ids: list[int], texts: list[str]) -> None:
    full = tokenizer.decode(ids, skip_special_tokens=False)
    assert "".join(texts) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in text for text in texts)


def test_tables_are_exact_byte_level(tokenizer: Tokenizer) -> None:
    table = token_table(tokenizer)
    assert table.byte_level and table.exact
    assert table.size >= tokenizer.vocab_size


@pytest.mark.parametrize(
    ("text", "ids", "texts"),
    [
        ("龘", [82912, 246], ["", "龘"]),
        ("🦩", [123918, 102], ["", "🦩"]),
        ("🫠", [9284, 104, 254], ["", "", "🫠"]),
    ],
)
def test_split_characters_qwen(qwen: Tokenizer, text: str, ids: list[int], texts: list[str]):
    assert qwen.encode(text, add_special_tokens=False) == ids
    for token_id in ids:  # each piece alone decodes to U+FFFD
        assert qwen.decode([token_id]) == "\ufffd"
    resolved = resolve_logprob_tokens(qwen, ids, entries_for(ids))
    assert [r.text for r in resolved] == texts
    assert b"".join(bytes(r.bytes) for r in resolved) == text.encode()
    assert [r.top[0].text for r in resolved] == texts  # the sampled token listed first


@pytest.mark.parametrize("text", TEXTS)
def test_fixed_texts_join_exactly(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    resolved = resolve_logprob_tokens(tokenizer, ids, entries_for(ids, 3))
    texts = [r.text for r in resolved]
    check_exact(tokenizer, ids, texts)
    assert "".join(texts) == tokenizer.decode(ids)
    assert b"".join(bytes(r.bytes) for r in resolved) == tokenizer.decode(ids).encode()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(st.characters(exclude_categories=["Cs"]), max_size=40))
def test_random_unicode_text(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    resolved = resolve_logprob_tokens(tokenizer, ids, entries_for(ids, 2))
    texts = [r.text for r in resolved]
    check_exact(tokenizer, ids, texts)
    full = tokenizer.decode(ids)
    if "\ufffd" not in full:
        assert b"".join(bytes(r.bytes) for r in resolved) == full.encode()


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_random_token_ids_match_decode_exactly(
    name: str, tokenizer: Tokenizer, data: st.DataObject
) -> None:
    """Any id sequence, invalid UTF-8 included: joined texts == decode, U+FFFD and all."""
    table = token_table(tokenizer)
    # Mostly byte pieces (split characters, stray continuation bytes), some whole tokens.
    single_bytes = [
        i for i in range(table.size) if len(table.raw[i]) == 1 and table.raw[i][0] >= 0x80
    ]
    id_strategy = st.one_of(st.sampled_from(single_bytes), st.integers(0, tokenizer.vocab_size - 1))
    ids = data.draw(st.lists(id_strategy, max_size=30))
    resolved = resolve_logprob_tokens(tokenizer, ids, entries_for(ids))
    assert "".join(r.text for r in resolved) == tokenizer.decode(ids, skip_special_tokens=False)
    assert all(r.bytes == list(table.raw[r.token_id]) for r in resolved)


def test_alternatives_see_the_same_pending_bytes(qwen: Tokenizer) -> None:
    # After 82912 (first part of 龘) is pending: 246 completes it, " the" breaks it, and 82912
    # itself starts a new character (the pending one becomes U+FFFD).
    the = qwen.encode(" the", add_special_tokens=False)[0]
    ids = [82912, 246, the]
    entries = [
        (82912, -0.1, [(82912, -0.1), (the, -2.0)]),
        (246, -0.2, [(246, -0.2), (the, -3.0), (82912, -4.0), (123918, -5.0)]),
        (the, -0.3, [(the, -0.3), (82912, -1.0)]),
    ]
    first, second, third = resolve_logprob_tokens(qwen, ids, entries)
    assert [alt.text for alt in first.top] == ["", " the"]
    assert [alt.text for alt in second.top] == ["龘", "\ufffd the", "\ufffd", "\ufffd"]
    assert second.top[1].bytes == list(b" the")
    # At the end of a finished output an incomplete alternative is flushed like the chosen
    # token would be: what it would have added to the final decode.
    assert [alt.text for alt in third.top] == [" the", "\ufffd"]


@pytest.mark.parametrize("fallback", [False, True], ids=["exact", "fallback"])
def test_rows_wider_than_a_byte(name: str, tokenizer: Tokenizer, fallback: bool) -> None:
    """300 alternatives per position (``--max-logprobs -1`` allows the vocabulary): each gets
    the text it adds at its own position, after the pending bytes of a split character."""
    decoder = fallback_decoder(name) if fallback else TokenTextDecoder(tokenizer)
    raw = decoder.table.raw
    others = [i for i in range(1000, 3000) if raw[i].isascii()][:299]
    ids = tokenizer.encode("龘龘 x", add_special_tokens=False)
    entries = [(t, -0.5, [(t, -0.5), *((o, -1.0 - j) for j, o in enumerate(others))]) for t in ids]
    resolved, _ = decoder.resolved(LogprobInput.from_entries(entries))
    texts = [r.text for r in resolved]
    check_exact(tokenizer, ids, texts)
    for position, entry in enumerate(resolved):
        before = "".join(texts[:position])
        assert len(entry.top) == 300
        for alt in entry.top[1:]:  # ASCII: it ends any pending character
            full = tokenizer.decode([*ids[:position], alt.token_id], skip_special_tokens=False)
            assert full == before + alt.text


def test_prompt_tail_repairs_first_output_tokens(qwen: Tokenizer) -> None:
    prompt = [*qwen.encode("Say it: ", add_special_tokens=False), 9284]  # 🫠 starts in the prompt
    ids = [104, 254, *qwen.encode(" done", add_special_tokens=False)]
    with_context = resolve_logprob_tokens(qwen, ids, entries_for(ids), prompt_token_ids=prompt)
    assert [r.text for r in with_context][:2] == ["", "🫠"]
    without = resolve_logprob_tokens(qwen, ids, entries_for(ids))
    assert "".join(r.text for r in without) == qwen.decode(ids)  # stray bytes: U+FFFD
    # A prompt that ends on a whole character changes nothing.
    clean_prompt = qwen.encode("Say it:", add_special_tokens=False)
    same = resolve_logprob_tokens(qwen, ids, entries_for(ids), prompt_token_ids=clean_prompt)
    assert [r.text for r in same] == [r.text for r in without]


def test_output_cut_inside_a_character(qwen: Tokenizer) -> None:
    ids = [*qwen.encode("ok ", add_special_tokens=False), 9284, 104]  # 🫠 without its last byte
    resolved = resolve_logprob_tokens(qwen, ids, entries_for(ids, 2))
    check_exact(qwen, ids, [r.text for r in resolved])
    assert resolved[-1].text.endswith("\ufffd")
    assert resolved[-1].top[0].text == resolved[-1].text


def test_special_tokens_keep_their_content(qwen: Tokenizer) -> None:
    ids = [*qwen.encode("<think>hi</think>", add_special_tokens=False), qwen.eos_token_id]
    resolved = resolve_logprob_tokens(qwen, ids, entries_for(ids))
    assert resolved[0].text == "<think>"
    assert resolved[-1].text == "<|im_end|>"
    assert bytes(resolved[-1].bytes) == b"<|im_end|>"


def test_chunks_with_carried_state_equal_one_pass(tokenizer: Tokenizer) -> None:
    text = "".join(TEXTS)
    ids = tokenizer.encode(text, add_special_tokens=False)
    logprobs = LogprobInput.from_entries(entries_for(ids, 3))
    decoder = TokenTextDecoder(tokenizer)
    whole, _ = decoder.resolved(logprobs)
    pieces = []
    context = DecodeContext()
    for start in range(0, len(ids), 3):
        chunk = LogprobInput(
            logprobs.token_ids[start : start + 3],
            logprobs.logprobs[start : start + 3],
            logprobs.top_ids[start : start + 3],  # type: ignore[index]
            logprobs.top_logprobs[start : start + 3],  # type: ignore[index]
        )
        final = start + 3 >= len(ids)
        resolved, context = decoder.resolved(chunk, context=context, final=final)
        context = DecodeContext.from_json(orjson.loads(orjson.dumps(context.to_json())))
        pieces.extend(resolved)
    assert [r.to_json() for r in pieces] == [r.to_json() for r in whole]


def json_entries(width: int | str, ids: list[int]) -> list[tuple]:
    """Entries of each shape the JSON writers take, with -inf and NaN logprobs."""
    if width == "ragged":
        entries = [(t, -0.5, [(t, -0.5)] * (i % 3)) for i, t in enumerate(ids)]
    elif width == "equal texts":  # alternatives whose texts coincide (a dict keeps one)
        entries = [(t, -0.5, [(t, -0.5), (t, -1.5), (82912, -2.0), (9284, -3.0)]) for t in ids]
    else:
        entries = entries_for(ids, max(0, int(width) - 1)) if width else [(t, -0.5) for t in ids]
    entries[1] = (entries[1][0], -math.inf, *entries[1][2:])
    entries[2] = (entries[2][0], math.nan, *entries[2][2:])
    return entries


JSON_SHAPES = [0, 1, 5, 300, "ragged", "equal texts"]
JSON_TEXT = 'Hi 龘🦩🫠 "quoted" \\ done'


@pytest.mark.parametrize("width", JSON_SHAPES)
def test_json_matches_objects(qwen: Tokenizer, width: int | str) -> None:
    ids = qwen.encode(JSON_TEXT, add_special_tokens=False)
    entries = json_entries(width, ids)
    body = chat_logprobs_json(qwen, ids, LogprobInput.from_entries(entries))
    objects = resolve_logprob_tokens(qwen, ids, entries)
    assert orjson.loads(body) == {"content": [r.to_json() for r in objects]}
    assert orjson.loads(body)["content"][1]["logprob"] == -9999.0


@pytest.mark.parametrize("width", JSON_SHAPES)
@pytest.mark.parametrize("chunk", [3, 100])
def test_completion_logprobs_match_objects(qwen: Tokenizer, width: int | str, chunk: int) -> None:
    """The completions shape, chunk by chunk with carried state, equals the objects' form."""
    ids = [*qwen.encode(JSON_TEXT, add_special_tokens=False), 9284, 104]  # ends mid-character
    entries = json_entries(width, ids)
    objects = resolve_logprob_tokens(qwen, ids, entries)
    decoder = TokenTextDecoder(qwen)
    context, offset = DecodeContext(), 5
    parts: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for start in range(0, len(ids), chunk):
        logprobs = LogprobInput.from_entries(entries[start : start + chunk])
        part, context = completion_logprobs_from(
            decoder,
            logprobs,
            context=context,
            final=start + chunk >= len(ids),
            text_offset=offset,
        )
        offset += sum(map(len, part["tokens"]))
        for key, values in part.items():
            parts[key].extend(values)
    texts = [r.text for r in objects]
    assert parts == {
        "tokens": texts,
        "token_logprobs": [json_logprob(r.logprob) for r in objects],
        "top_logprobs": [{a.text: json_logprob(a.logprob) for a in r.top} for r in objects],
        "text_offset": [5 + len("".join(texts[:i])) for i in range(len(texts))],
    }


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_advance_ends_where_resolve_does(qwen: Tokenizer, data: st.DataObject) -> None:
    """A chunk without logprobs moves the logprob decoder as resolving its texts would."""
    table = token_table(qwen)
    empty = [i for i in range(table.size) if not table.raw[i]][:5]
    ids_strategy = st.lists(
        st.sampled_from(byte_pieces("qwen3-tiny") + empty) | st.integers(0, 1000), max_size=12
    )
    decoder = TokenTextDecoder(qwen)
    context = DecodeContext(pending=data.draw(st.sampled_from([b"", b"\xe4", b"\xf0\x9f"])))
    for ids in data.draw(st.lists(ids_strategy, min_size=1, max_size=4)):
        final = data.draw(st.booleans())
        expected = decoder.resolve(ids, context=context, final=final).context
        assert decoder.advance(ids, context, final=final) == expected
        context = expected


def generate_form(entries: list[tuple]) -> list[dict]:
    """Entries as /inference/v1/generate writes them."""

    def entry(token_id: int, logprob: float) -> dict:
        return {"token": f"token_id:{token_id}", "token_id": token_id, "logprob": logprob}

    return [
        {**entry(t, lp), "rank": 1, "bytes": None, "top_logprobs": [entry(*a) for a in top]}
        for t, lp, top in entries
    ]


@pytest.mark.parametrize("width", [0, 1, 5, "ragged"])
def test_client_entries_read_into_columns(width: int | str) -> None:
    ids = [5, 82912, 246, 9284, 104, 254]
    if width == "ragged":
        entries = [(t, -0.5, [(t, -0.5)] * (i % 3)) for i, t in enumerate(ids)]
    else:
        entries = [(t, -0.5, top[: int(width)]) for t, _, top in entries_for(ids, 4)]
    expected = LogprobInput.from_entries(entries)

    def rows(columns: LogprobInput) -> tuple[list, list]:
        return [list(r) for r in columns.top_ids or ()], [
            list(r) for r in columns.top_logprobs or ()
        ]

    columns = logprob_input(generate_form(entries))
    assert (list(columns.token_ids), columns.logprobs, *rows(columns)) == (
        ids,
        expected.logprobs,
        expected.top_ids,
        expected.top_logprobs,
    )
    # Placeholders only and integer logprobs: the same ids, logprobs as floats.
    placeholders = [
        {
            "token": f"token_id:{t}",
            "logprob": -1,
            "top_logprobs": [{"token": f"token_id:{a}", "logprob": 0} for a, _ in top],
        }
        for t, _, top in entries
    ]
    columns = logprob_input(placeholders)
    assert list(columns.token_ids) == ids and rows(columns)[0] == expected.top_ids
    numbers = [*columns.logprobs, *itertools.chain.from_iterable(columns.top_logprobs or ())]
    assert all(type(lp) is float for lp in numbers)


def test_fallback_path_is_exact_too(name: str, tokenizer: Tokenizer) -> None:
    """The decode-with-context path (for non byte-level tokenizers) on known tokenizers."""
    decoder = fallback_decoder(name)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        resolved, _ = decoder.resolved(LogprobInput.from_entries(entries_for(ids, 2)))
        check_exact(tokenizer, ids, [r.text for r in resolved])


def test_client_mistakes_are_value_errors(qwen: Tokenizer) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        resolve_logprob_tokens(qwen, [1, 10**9], [(1, 0.0), (10**9, 0.0)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        resolve_logprob_tokens(qwen, [-1], [(-1, 0.0)])
    with pytest.raises(ValueError):
        resolve_logprob_tokens(qwen, [1, 2], [(1, 0.0)])
    with pytest.raises(ValueError, match="numbers"):
        chat_logprobs_json(qwen, [1], LogprobInput([1], ["x"]))  # type: ignore[list-item]
    with pytest.raises(ValueError):
        DecodeContext.from_json({"p": "f0f0f0f0"})


@pytest.mark.parametrize(
    "logprobs",
    [
        LogprobInput([1, 2], [0.0, "x"]),  # type: ignore[list-item]
        LogprobInput([1, 2], [0.0, True]),
        LogprobInput([1, 2], [0.0, 0.0], [[1], [2]], [[0.0], ["x"]]),  # type: ignore[list-item]
        LogprobInput([1, 2], [0.0, 0.0], [[1], [2]], [[0.0], [[1.0]]]),  # type: ignore[list-item]
        LogprobInput([1, 2], [0.0, 0.0], [[1], [2, 3]], [[0.0], [0.0, "x"]]),  # type: ignore[list-item]
        LogprobInput([1, 2], [0.0, 0.0], [[1], [2]], [[0.0], [0.0, 1.0]]),  # width mismatch
        LogprobInput([1, 2], [0.0, 0.0], [[1], [2.5]], [[0.0], [0.0]]),  # type: ignore[list-item]
        LogprobInput([1, "2"], [0.0, 0.0]),  # type: ignore[list-item]
        LogprobInput([1, 2], [0.0]),
    ],
)
def test_bad_logprob_inputs_are_value_errors(qwen: Tokenizer, logprobs: LogprobInput) -> None:
    decoder = TokenTextDecoder(qwen)
    with pytest.raises(ValueError):
        chat_logprobs_json_from(decoder, logprobs)
    with pytest.raises(ValueError):
        decoder.resolved(logprobs)
