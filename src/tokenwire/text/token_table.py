"""Per-tokenizer token table: each id's raw bytes and the text it adds from a clean state.

Built once per tokenizer (about a second for a 150k vocabulary) and shared by every request,
so resolving token texts (``token_text``) and writing logprob JSON (``logprob_json``) are table
lookups, and only tokens next to a split UTF-8 character go through a real decoder.

For byte-level tokenizers the decoder state between tokens is only the pending bytes of an
unfinished character (at most 3 bytes); ``TokenTable.exact`` says the Rust decoder is a plain
byte concatenation, checked over the whole vocabulary when the table is built. Tokenizers whose
decoder is not (SentencePiece ``▁`` with byte fallback, strip decoders) take a fallback that
decodes with up to ``CONTEXT_TOKENS`` preceding tokens, so ``DecodeContext`` carries those ids.
"""

from __future__ import annotations

import codecs
import json
import re
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "CACHE_LIMIT",
    "CONTEXT_TOKENS",
    "DecodeContext",
    "TokenTable",
    "TokenizerLike",
    "feed",
    "pending_after",
    "token_table",
]

#: Preceding tokens used as context (API contract: "up to 4 preceding tokens").
CONTEXT_TOKENS = 4
#: Entries a lazily filled per-table cache may hold before it is cleared.
CACHE_LIMIT = 1 << 18
_MAX_HELD = 64  # fallback tokenizers: tokens of one unfinished character

_INT_TYPES = {int, bool}
_utf8_decode = codecs.utf_8_decode
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenizerLike(Protocol):
    """What this module reads from ``tokenwire.text.tokenizer.Tokenizer``."""

    backend: Any
    vocab_size: int

    @property
    def special_token_ids(self) -> frozenset[int]: ...


def _gpt2_char_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` (what the ByteLevel decoder applies)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


_CHAR_TO_BYTE = _gpt2_char_to_byte()


def feed(data: bytes, final: bool) -> tuple[str, bytes]:
    """Decode ``data`` from a clean state; return the text and the bytes still pending.

    Only an incomplete character at the end stays pending; invalid bytes become U+FFFD at
    once, as in the Rust decoder's lossy UTF-8.
    """
    text, used = _utf8_decode(data, "replace", final)
    return text, data[used:]


def pending_after(data: bytes) -> bytes:
    """The incomplete-character tail left after decoding ``data``.

    UTF-8 resynchronises within 3 bytes, so a window that starts mid-character still ends in
    the same state as the full stream.
    """
    return feed(data, False)[1]


@dataclass(frozen=True, slots=True)
class DecodeContext:
    """Decoder state between two tokens, small enough to carry in a stream state.

    ``pending`` holds bytes of an unfinished character (byte-level tables); ``context`` and
    ``held`` are token ids (fallback tables): up to 4 completed tokens, then the tokens whose
    text is still incomplete.
    """

    pending: bytes = b""
    context: tuple[int, ...] = ()
    held: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"p": self.pending.hex(), "c": list(self.context), "h": list(self.held)}

    @classmethod
    def from_json(cls, data: Any) -> DecodeContext:
        """Parse what ``to_json`` wrote; ``ValueError`` for anything else (client input)."""
        if not isinstance(data, dict):
            raise ValueError("decode context must be an object")
        try:
            pending = bytes.fromhex(data.get("p", ""))
            context = tuple(data.get("c", ()))
            held = tuple(data.get("h", ()))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad decode context: {exc}") from None
        if len(pending) > 3:
            raise ValueError("decode context holds more than 3 pending bytes")
        for ids in (context, held):
            if not all(type(i) is int and i >= 0 for i in ids):
                raise ValueError("decode context ids must be non-negative integers")
        if len(context) > CONTEXT_TOKENS or len(held) > _MAX_HELD:
            raise ValueError("decode context holds too many tokens")
        return cls(pending, context, held)


class TokenTable:
    """Per-id facts for one tokenizer, built once (about a second for a 150k vocabulary).

    ``exact`` is True for byte-level tokenizers whose decode is a byte concatenation (verified
    against the Rust decoder over the whole vocabulary); otherwise the fallback path is used.
    """

    def __init__(self, tokenizer: TokenizerLike, *, force_fallback: bool = False) -> None:
        self.tokenizer = tokenizer
        backend = tokenizer.backend
        self.size: int = max(tokenizer.vocab_size, backend.get_vocab_size(with_added_tokens=True))
        self.special: frozenset[int] = frozenset(tokenizer.special_token_ids)
        pieces: list[str | None] = list(map(backend.id_to_token, range(self.size)))
        self.byte_level: bool = _is_byte_level(backend)
        to_bytes = _byte_level_bytes if self.byte_level else _sentencepiece_bytes
        # Tuples of str/bytes: the garbage collector stops scanning them after one pass.
        self.raw: tuple[bytes, ...] = tuple(map(to_bytes, pieces))
        self.exact: bool = self.byte_level and not force_fallback and self._matches_backend_decode()
        decoded = [_utf8_decode(data, "replace", False) for data in self.raw]
        #: Text a token adds from a clean decoder state (its incomplete tail left out).
        self.text: tuple[str, ...] = tuple(text for text, _ in decoded)
        #: 1 where a token leaves no pending bytes from a clean state: the fast path.
        self.clean: bytes = bytes(
            used == len(data) for (_, used), data in zip(decoded, self.raw, strict=True)
        )
        #: What a token adds after some pending bytes, keyed ``id << 24 | pending``.
        self.after_pending: dict[int, str] = {}

    def _matches_backend_decode(self) -> bool:
        """Check that decode == lossy UTF-8 of the joined raw bytes, for every id."""
        ids = list(range(self.size))
        chunks = [ids[i : i + 64] for i in range(0, len(ids), 64)]
        decoded = self.tokenizer.backend.decode_batch(chunks, skip_special_tokens=False)
        raw = self.raw
        return all(
            text == b"".join(map(raw.__getitem__, chunk)).decode("utf-8", "replace")
            for chunk, text in zip(chunks, decoded, strict=True)
        )

    def check_ids(self, ids: Iterable[int]) -> None:
        """Raise ``ValueError`` for a non-integer or an id outside the vocabulary."""
        ids = ids if isinstance(ids, list | tuple) else list(ids)
        if not ids:
            return
        if not set(map(type, ids)) <= _INT_TYPES:
            raise ValueError("token ids must be integers")
        if min(ids) < 0 or max(ids) >= self.size:
            bad = next(i for i in ids if not 0 <= i < self.size)
            raise ValueError(f"token id {bad} is outside the vocabulary (size {self.size})")


def _is_byte_level(backend: Any) -> bool:
    decoder = backend.decoder
    if decoder is None:
        return False
    spec = json.loads(decoder.__getstate__())
    if spec.get("type") == "Sequence":
        parts = spec.get("decoders") or []
        return bool(parts) and all(part.get("type") == "ByteLevel" for part in parts)
    return spec.get("type") == "ByteLevel"


def _byte_level_bytes(piece: str | None) -> bytes:
    """Raw bytes the ByteLevel decoder gives a piece: mapped chars, else the piece's UTF-8."""
    if piece is None:
        return b""
    try:
        return bytes(map(_CHAR_TO_BYTE.__getitem__, piece))
    except KeyError:
        return piece.encode("utf-8")


def _sentencepiece_bytes(piece: str | None) -> bytes:
    """Best-effort raw bytes for fallback tokenizers: ``<0xNN>`` and ``▁`` spaces."""
    if piece is None:
        return b""
    match = _BYTE_FALLBACK.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace("▁", " ").encode("utf-8")


_TABLES: weakref.WeakKeyDictionary[Any, TokenTable] = weakref.WeakKeyDictionary()


def token_table(tokenizer: TokenizerLike) -> TokenTable:
    """The table for ``tokenizer``, built on first use and cached with the tokenizer."""
    table = _TABLES.get(tokenizer)
    if table is None:
        table = TokenTable(tokenizer)
        _TABLES[tokenizer] = table
    return table
