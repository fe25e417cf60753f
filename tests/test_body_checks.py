"""The front middleware's surrogate check against what a JSON parser makes of the same body."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenwire.api.asgi import has_lone_surrogate

# Pieces of a JSON string's contents: surrogate escapes in both cases, pairs split by escaped
# backslashes, text that only looks like an escape (``\\ud800``: a backslash, then "ud800").
PIECES = [
    "a",
    "ud800",
    "ud83d",
    "\\\\",
    "\\ud83d",
    "\\uD83D",
    "\\ude00",
    "\\uDE00",
    "\\udbff",
    "\\udc00",
    "\\uDFFF",
    "\\u0041",
    "\\u4e2d",
    "\\ud7ff",
    "\\ue000",
    '\\"',
]


def parsed_has_lone_surrogate(body: bytes) -> bool:
    """The reference: json.loads keeps a lone surrogate as such, and UTF-8 cannot encode it."""
    try:
        json.loads(body)["text"].encode()
    except UnicodeEncodeError:
        return True
    return False


@settings(max_examples=500)
@given(st.lists(st.sampled_from(PIECES), max_size=12))
def test_agrees_with_the_json_parser(pieces: list[str]) -> None:
    body = ('{"text": "' + "".join(pieces) + '"}').encode()
    assert has_lone_surrogate(body) == parsed_has_lone_surrogate(body), body


def test_lone_surrogates_are_found_and_pairs_accepted() -> None:
    assert has_lone_surrogate(json.dumps({"text": "a\ud800b"}).encode())
    assert has_lone_surrogate(json.dumps({"text": "a\udfff"}).encode())
    assert has_lone_surrogate(b'{"text": "\\uDBFF\\u0041"}')
    assert not has_lone_surrogate(json.dumps({"text": "flamingo \U0001f9a9"}).encode())
    assert not has_lone_surrogate(b'{"text": "\\uD83E\\uDDA9 \\\\ud800"}')
    assert not has_lone_surrogate(b'{"ids": [1, 2, 3], "text": "\\u4e2d\\u6587"}')
    # An escaped backslash, then text that looks like a high half: the low escape is alone.
    assert has_lone_surrogate(b'{"text": "\\\\ud83d\\ude00"}')
