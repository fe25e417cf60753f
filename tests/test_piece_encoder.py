"""Piecewise encoding gives the tokenizer's own ids: on every model tokenwire ships, for texts with
added tokens anywhere (inside user content too), NFC-sensitive and byte-level text, cold and from
remembered pieces, and under eviction; tokenizers where pieces could differ are left whole."""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

from tests.chat_fixtures import CONVERSATIONS
from tests.test_logprob_tokens import load
from tokenwire.assets import prepare
from tokenwire.text.chat_template import ChatTemplate, load_model_chat_template
from tokenwire.text.piece_encoder import PieceEncoder
from tokenwire.text.tokenizer import PIECEWISE_MIN_CHARS, Tokenizer

MODELS = ["qwen3-tiny", "smollm2-135m-instruct", "qwen2-vl-tiny"]
WORDS = ["the", " model", "réponse", "数据", "e\u0301", "\u212b", "🙂", "\r\n", "\t", "  ", "12345"]


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def tokenizer(model: str) -> Tokenizer:
    return load(model)


def whole(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.backend.encode(text, add_special_tokens=False).ids


def added_tokens(tokenizer: Tokenizer) -> list[str]:
    return [token.content for token in tokenizer.backend.get_added_tokens_decoder().values()]


def conversation_text(tokenizer: Tokenizer, rng: random.Random, turns: int) -> str:
    """A long render-like text: the model's template markers, with added tokens (and halves of
    them) also inside the content."""
    specials = added_tokens(tokenizer)
    parts = []
    for _ in range(turns):
        words = [rng.choice(WORDS + specials + ["<|im", "_end|>", "<"]) for _ in range(80)]
        parts.append(f"<|im_start|>user\n{''.join(words)}<|im_end|>\n")
    return "".join(parts)


def test_every_shipped_tokenizer_encodes_piecewise(tokenizer: Tokenizer) -> None:
    assert tokenizer.pieces is not None


def test_template_renders_encode_to_the_same_ids(model: str, tokenizer: Tokenizer) -> None:
    source = load_model_chat_template(prepare(model))
    assert source is not None
    template = ChatTemplate(source, special_tokens=tokenizer.special_tokens_map)
    pieces = PieceEncoder.for_backend(tokenizer.backend)
    assert pieces is not None
    for messages in CONVERSATIONS.values():
        text = template.render(messages, add_generation_prompt=True)
        assert pieces.encode(text) == whole(tokenizer, text)
        assert pieces.encode(text) == whole(tokenizer, text)  # from remembered pieces


def test_the_next_turn_reuses_the_history_and_stays_exact(tokenizer: Tokenizer) -> None:
    rng = random.Random(7)
    history = conversation_text(tokenizer, rng, 40)
    pieces = PieceEncoder.for_backend(tokenizer.backend)
    assert pieces is not None
    assert pieces.encode(history) == whole(tokenizer, history)
    held = pieces.remembered_bytes
    turn = history + "<|im_start|>user\nNext? réponse 数据<|im_end|>\n<|im_start|>assistant\n"
    assert pieces.encode(turn) == whole(tokenizer, turn)
    # Only the new pieces were added.
    assert 0 < pieces.remembered_bytes - held < held / 10
    # Through the tokenizer's own entry point, where long texts go piecewise.
    assert len(turn) >= PIECEWISE_MIN_CHARS
    assert tokenizer.encode(turn, add_special_tokens=False) == whole(tokenizer, turn)
    with_specials = tokenizer.backend.encode(turn, add_special_tokens=True).ids
    assert tokenizer.encode(turn, add_special_tokens=True) == with_specials


@functools.cache
def small_pieces() -> PieceEncoder:
    """A small bound, so that the examples also run through eviction."""
    return PieceEncoder(load("qwen3-tiny").backend, max_bytes=50_000)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_text_encodes_to_the_same_ids(data: st.DataObject) -> None:
    tokenizer = load("qwen3-tiny")
    alphabet = st.sampled_from([*WORDS, *added_tokens(tokenizer), "<", "|", ">", "a", " ", "\n"])
    text = "".join(data.draw(st.lists(alphabet, max_size=60)))
    text += data.draw(st.text(max_size=40))
    assert small_pieces().encode(text) == whole(tokenizer, text)


def test_a_small_bound_evicts_and_stays_exact() -> None:
    tokenizer = load("qwen3-tiny")
    pieces = PieceEncoder(tokenizer.backend, max_bytes=20_000)
    rng = random.Random(3)
    for _ in range(5):
        text = conversation_text(tokenizer, rng, 30)
        assert pieces.encode(text) == whole(tokenizer, text)
        assert pieces.remembered_bytes <= 20_000


def test_tokenizers_whose_pieces_could_differ_are_left_whole() -> None:
    stripping = RustTokenizer.from_str(load("qwen3-tiny").backend.to_str())
    stripping.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert PieceEncoder.for_backend(stripping) is None
    truncating = RustTokenizer.from_str(load("qwen3-tiny").backend.to_str())
    truncating.enable_truncation(16)
    assert PieceEncoder.for_backend(truncating) is None
    literal = RustTokenizer.from_str(load("qwen3-tiny").backend.to_str())
    literal.encode_special_tokens = True
    assert PieceEncoder.for_backend(literal) is None
