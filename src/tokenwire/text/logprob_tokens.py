"""Text and bytes of logprob tokens, exact against the full decode.

A byte-level BPE token can hold part of a UTF-8 character, so decoding it alone gives U+FFFD.
Here every token's text is what it *adds* to the decoded string: one UTF-8 decoder runs across
the tokens, and a token gets the characters its bytes complete. Invariants (byte-level
tokenizers, checked against the Rust decoder when the table is built):

- joining the chosen tokens' texts gives ``tokenizer.decode(ids, skip_special_tokens=False)``;
- a token that only starts a character gets ``""``, the token that completes it gets the
  character, so U+FFFD appears only where the full decode has one (truly invalid bytes, or an
  output cut inside a character: that U+FFFD goes to the last token when ``final``);
- an alternative (top logprob) gets what *it* would add after the same preceding bytes;
- ``bytes`` is the token's raw bytes (special tokens: their content as UTF-8).

The decoder state between tokens is only the pending bytes of an unfinished character (at most
3 bytes), so a stream can be resumed from it; the first output tokens take that state from the
tail of the prompt. Cost is O(n): a per-id table (raw bytes, text from a clean state, whether
bytes stay pending) is built once per tokenizer, and only tokens next to a split character go
through a real decoder.

Tokenizers whose decoder is not a plain byte concatenation (SentencePiece ``▁`` with byte
fallback, strip decoders) take a fallback: each token is decoded with up to 4 preceding tokens
of context and a character that is still incomplete is held back.
"""

from __future__ import annotations

import codecs
import itertools
import json
import math
import re
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import orjson

__all__ = [
    "CONTEXT_TOKENS",
    "DecodeContext",
    "LogprobEntry",
    "LogprobInput",
    "ResolvedLogprob",
    "ResolvedToken",
    "TokenTable",
    "TokenTextDecoder",
    "chat_logprobs_json",
    "resolve_logprob_tokens",
    "token_table",
]

#: Preceding tokens used as context (API contract: "up to 4 preceding tokens").
CONTEXT_TOKENS = 4
#: Logprob placed in JSON for -inf / NaN (JSON has neither).
NON_FINITE_LOGPROB = -9999.0
#: Most alternatives per position (the API allows 20).
RANKS = 256
_CACHE_LIMIT = 1 << 18
_MAX_HELD = 64  # fallback tokenizers: tokens of one unfinished character

_INT_TYPES = {int, bool}
_NUMBER_TYPES = {int, float}
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


def _feed(data: bytes, final: bool) -> tuple[str, bytes]:
    """Decode ``data`` from a clean state; return the text and the bytes still pending.

    Only an incomplete character at the end stays pending; invalid bytes become U+FFFD at
    once, as in the Rust decoder's lossy UTF-8.
    """
    text, used = _utf8_decode(data, "replace", final)
    return text, data[used:]


def _pending_after(data: bytes) -> bytes:
    """The incomplete-character tail left after decoding ``data``.

    UTF-8 resynchronises within 3 bytes, so a window that starts mid-character still ends in
    the same state as the full stream.
    """
    return _feed(data, False)[1]


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
        self._fragments: _JsonFragments | None = None

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

    @property
    def fragments(self) -> _JsonFragments:
        if self._fragments is None:
            self._fragments = _JsonFragments(self)
        return self._fragments


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


# --------------------------------------------------------------------------------------------
# Inputs and outputs


class LogprobEntry(NamedTuple):
    """One position as the engine reports it (ids already parsed from ``token_id:N``)."""

    token_id: int
    logprob: float
    top: Sequence[tuple[int, float]] | None = None


@dataclass(frozen=True, slots=True)
class LogprobInput:
    """Logprobs of one choice in columns, the shape the fast JSON path wants.

    ``top_ids[i]`` / ``top_logprobs[i]`` are the alternatives at position ``i``.
    """

    token_ids: Sequence[int]
    logprobs: Sequence[float]
    top_ids: Sequence[Sequence[int]] | None = None
    top_logprobs: Sequence[Sequence[float]] | None = None

    @classmethod
    def from_entries(cls, entries: Iterable[LogprobEntry | Sequence[Any]]) -> LogprobInput:
        rows = [LogprobEntry(*entry) for entry in entries]
        has_top = any(row.top is not None for row in rows)
        return cls(
            token_ids=[row.token_id for row in rows],
            logprobs=[row.logprob for row in rows],
            top_ids=[[t[0] for t in row.top or ()] for row in rows] if has_top else None,
            top_logprobs=[[t[1] for t in row.top or ()] for row in rows] if has_top else None,
        )

    def check(self) -> int | None:
        """Raise ``ValueError`` when the columns disagree in length (client input).

        Returns the number of alternatives per position, or None when it varies.
        """
        n = len(self.token_ids)
        if len(self.logprobs) != n:
            raise ValueError(f"{len(self.logprobs)} logprobs for {n} token ids")
        if (self.top_ids is None) != (self.top_logprobs is None):
            raise ValueError("top_ids and top_logprobs must be given together")
        if self.top_ids is None or self.top_logprobs is None:
            return 0
        if len(self.top_ids) != n or len(self.top_logprobs) != n:
            raise ValueError("top logprobs must have one row per position")
        widths = set(map(len, self.top_ids))
        uniform = len(widths) <= 1 and widths == set(map(len, self.top_logprobs))
        # Ragged rows (rare): compare row by row.
        if not uniform and list(map(len, self.top_ids)) != list(map(len, self.top_logprobs)):
            raise ValueError("each position needs as many top logprobs as top ids")
        if widths and max(widths) >= RANKS:
            raise ValueError(f"at most {RANKS - 1} top logprobs per position")
        return (widths.pop() if widths else 0) if len(widths) <= 1 else None


@dataclass(slots=True)
class ResolvedToken:
    token_id: int
    text: str
    bytes: list[int]
    logprob: float

    def to_json(self) -> dict[str, Any]:
        return {"token": self.text, "logprob": _json_logprob(self.logprob), "bytes": self.bytes}


@dataclass(slots=True)
class ResolvedLogprob(ResolvedToken):
    top: list[ResolvedToken] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = ResolvedToken.to_json(self)
        data["top_logprobs"] = [alt.to_json() for alt in self.top]
        return data


def _json_logprob(value: float) -> float:
    return value if math.isfinite(value) else NON_FINITE_LOGPROB


# --------------------------------------------------------------------------------------------
# Resolution


class _Resolution(NamedTuple):
    """Texts that differ from ``TokenTable.text`` (rare), and the state after the last token.

    ``top`` is keyed ``position * RANKS + rank``: int keys keep the dict out of the garbage
    collector's way.
    """

    chosen: dict[int, str]
    top: dict[int, str]
    context: DecodeContext


class TokenTextDecoder:
    """Resolves token texts for one tokenizer; one instance can serve every request."""

    def __init__(self, tokenizer: TokenizerLike, table: TokenTable | None = None) -> None:
        self.tokenizer = tokenizer
        self.table = table if table is not None else token_table(tokenizer)

    def context_from_prompt(self, prompt_token_ids: Sequence[int] | None) -> DecodeContext:
        """Decoder state after the prompt, from its last ``CONTEXT_TOKENS`` tokens."""
        if not prompt_token_ids:
            return DecodeContext()
        tail = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.table.check_ids(tail)
        if self.table.exact:
            return DecodeContext(
                pending=_pending_after(b"".join(map(self.table.raw.__getitem__, tail)))
            )
        return DecodeContext(context=tuple(tail))

    def resolve(
        self,
        token_ids: Sequence[int],
        chosen_ids: Sequence[int] | None = None,
        top_ids: Sequence[Sequence[int]] | None = None,
        *,
        context: DecodeContext | None = None,
        final: bool = True,
        top_ids_checked: bool = False,
    ) -> _Resolution:
        """Texts for the chosen tokens and alternatives at each position of ``token_ids``.

        ``chosen_ids`` are the logprob entries' own ids (normally equal to ``token_ids``);
        ``final`` flushes an incomplete trailing character into the last position.
        """
        table = self.table
        table.check_ids(token_ids)
        if chosen_ids is not None and chosen_ids is not token_ids:
            table.check_ids(chosen_ids)
            if len(chosen_ids) != len(token_ids):
                raise ValueError(f"{len(chosen_ids)} logprob entries for {len(token_ids)} tokens")
        if top_ids is not None:
            if len(top_ids) != len(token_ids):
                raise ValueError("top logprobs must have one row per token")
            if not top_ids_checked:
                table.check_ids(list(itertools.chain.from_iterable(top_ids)))
        context = context or DecodeContext()
        if table.exact:
            return self._resolve_bytes(token_ids, chosen_ids, top_ids, context.pending, final)
        return self._resolve_fallback(token_ids, chosen_ids, top_ids, context, final)

    # -- byte-level tables ------------------------------------------------------------------

    def _resolve_bytes(
        self,
        ids: Sequence[int],
        chosen_ids: Sequence[int] | None,
        top_ids: Sequence[Sequence[int]] | None,
        pending: bytes,
        final: bool,
    ) -> _Resolution:
        table = self.table
        raw, text = table.raw, table.text
        n = len(ids)
        chosen: dict[int, str] = {}
        before: dict[int, bytes] = {}  # pending bytes before positions where it is non-empty
        flags = bytes(map(table.clean.__getitem__, ids))
        # Walk only the stretches around split characters; elsewhere the table text is right.
        i = 0 if pending else flags.find(0)
        while 0 <= i < n:
            token_id = ids[i]
            if pending:
                before[i] = pending
            piece, pending = _feed(pending + raw[token_id], False)
            if piece != text[token_id]:
                chosen[i] = piece
            i += 1
            if not pending:
                i = flags.find(0, i)
        last = n - 1
        if final and pending and n:
            chosen[last] = chosen.get(last, text[ids[last]]) + _feed(pending, True)[0]
            pending = b""

        def alternative(position: int, token_id: int) -> str | None:
            """Text of ``token_id`` at ``position``, or None when it equals the table text."""
            flush = final and position == last
            prior = before.get(position, b"")
            if not prior and not flush:
                return None
            piece, rest = _feed(prior + raw[token_id], False)
            if flush and rest:
                piece += _feed(rest, True)[0]
            return None if piece == text[token_id] else piece

        if chosen_ids is not None and chosen_ids is not ids and chosen_ids != ids:
            for position, (a, b) in enumerate(zip(ids, chosen_ids, strict=True)):
                if a != b:
                    piece = alternative(position, b)
                    if piece is None:
                        chosen.pop(position, None)
                    else:
                        chosen[position] = piece
        top: dict[int, str] = {}
        if top_ids is not None:
            cache = table.after_pending
            if len(cache) > _CACHE_LIMIT:
                cache.clear()
            for position, prior in before.items():
                if final and position == last:
                    continue
                tag = int.from_bytes(prior, "big")  # a lead byte first: never 0, so unique
                for rank, token_id in enumerate(top_ids[position]):
                    key = token_id << 24 | tag
                    piece = cache.get(key)
                    if piece is None:
                        piece = cache[key] = _feed(prior + raw[token_id], False)[0]
                    if piece != text[token_id]:
                        top[position * RANKS + rank] = piece
            if final and n:
                for rank, token_id in enumerate(top_ids[last]):
                    piece = alternative(last, token_id)
                    if piece is not None:
                        top[last * RANKS + rank] = piece
        return _Resolution(chosen, top, DecodeContext(pending=pending))

    # -- fallback: decode with context ------------------------------------------------------

    def _resolve_fallback(
        self,
        ids: Sequence[int],
        chosen_ids: Sequence[int] | None,
        top_ids: Sequence[Sequence[int]] | None,
        context: DecodeContext,
        final: bool,
    ) -> _Resolution:
        decode = self.tokenizer.backend.decode
        text = self.table.text
        ctx, held = list(context.context), list(context.held)
        n = len(ids)
        chosen: dict[int, str] = {}
        top: dict[int, str] = {}

        def added(window: list[int], base: str, token_id: int, flush: bool) -> str:
            full = decode([*window, token_id], skip_special_tokens=False)
            if full.endswith("\ufffd") and not flush:
                return ""
            return full[len(base) :] if full.startswith(base) else full

        for i, token_id in enumerate(ids):
            flush = final and i == n - 1
            window = ctx + held
            base = decode(ctx, skip_special_tokens=False)
            piece = added(window, base, token_id, flush)
            if chosen_ids is not None and chosen_ids[i] != token_id:
                chosen[i] = added(window, base, chosen_ids[i], flush)
            elif piece != text[token_id]:
                chosen[i] = piece
            if top_ids is not None:
                for rank, alt in enumerate(top_ids[i]):
                    alt_piece = added(window, base, alt, flush)
                    if alt_piece != text[alt]:
                        top[i * RANKS + rank] = alt_piece
            if piece or flush:
                ctx = [*window, token_id][-CONTEXT_TOKENS:]
                held = []
            else:
                held.append(token_id)
        return _Resolution(chosen, top, DecodeContext(context=tuple(ctx), held=tuple(held)))

    # -- plain text of a token stream -------------------------------------------------------

    def decode_stream(
        self,
        token_ids: Sequence[int],
        context: DecodeContext,
        *,
        final: bool,
        skip_special_tokens: bool = True,
    ) -> tuple[str, DecodeContext]:
        """Text of ``token_ids`` after ``context``, holding back an incomplete character.

        Joined over a stream, equals ``decode(all_ids, skip_special_tokens=...)``.
        """
        table = self.table
        table.check_ids(token_ids)
        ids = list(token_ids)
        if skip_special_tokens and table.special:
            special = table.special
            ids = [i for i in ids if i not in special]
        if table.exact:
            data = context.pending + b"".join(map(table.raw.__getitem__, ids))
            piece, pending = _feed(data, final)
            return piece, DecodeContext(pending=pending)
        resolution = self._resolve_fallback(ids, None, None, context, final)
        out = [resolution.chosen.get(i, table.text[t]) for i, t in enumerate(ids)]
        state = resolution.context
        if final and state.held:  # nothing left to attach the incomplete tail to
            decode = self.tokenizer.backend.decode
            base = decode(list(state.context), skip_special_tokens=False)
            full = decode([*state.context, *state.held], skip_special_tokens=False)
            out.append(full[len(base) :])
            state = DecodeContext(context=(*state.context, *state.held)[-CONTEXT_TOKENS:])
        return "".join(out), state

    # -- outputs ----------------------------------------------------------------------------

    def resolved(
        self,
        logprobs: LogprobInput,
        token_ids: Sequence[int] | None = None,
        *,
        context: DecodeContext | None = None,
        final: bool = True,
    ) -> tuple[list[ResolvedLogprob], DecodeContext]:
        """Objects for each position (convenient; the JSON path is faster)."""
        logprobs.check()
        numbers = itertools.chain(logprobs.logprobs, *(logprobs.top_logprobs or ()))
        if not set(map(type, numbers)) <= _NUMBER_TYPES:
            raise ValueError("logprobs must be numbers")
        ids = logprobs.token_ids if token_ids is None else token_ids
        resolution = self.resolve(
            ids, logprobs.token_ids, logprobs.top_ids, context=context, final=final
        )
        table = self.table
        text, raw = table.text, table.raw
        out: list[ResolvedLogprob] = []
        for i, (token_id, logprob) in enumerate(
            zip(logprobs.token_ids, logprobs.logprobs, strict=True)
        ):
            top: list[ResolvedToken] = []
            if logprobs.top_ids is not None and logprobs.top_logprobs is not None:
                for rank, (alt, alt_lp) in enumerate(
                    zip(logprobs.top_ids[i], logprobs.top_logprobs[i], strict=True)
                ):
                    alt_text = resolution.top.get(i * RANKS + rank, text[alt])
                    top.append(ResolvedToken(alt, alt_text, list(raw[alt]), alt_lp))
            chosen_text = resolution.chosen.get(i, text[token_id])
            out.append(ResolvedLogprob(token_id, chosen_text, list(raw[token_id]), logprob, top))
        return out, resolution.context

    def chat_logprobs_json(
        self,
        logprobs: LogprobInput,
        token_ids: Sequence[int] | None = None,
        *,
        context: DecodeContext | None = None,
        final: bool = True,
    ) -> tuple[bytes, DecodeContext]:
        """The chat ``logprobs`` object as JSON bytes (embed with ``orjson.Fragment``).

        Built from per-id JSON fragments joined in C: no per-entry dicts, which is what makes
        32k tokens x 5 alternatives cheap.
        """
        width = logprobs.check()
        ids = logprobs.token_ids if token_ids is None else token_ids
        fragments = self.table.fragments
        alt_heads = None
        if width and logprobs.top_ids is not None:
            # Looking the heads up first also checks the ids (unknown ids have no head).
            rows = logprobs.top_ids
            alt_heads = fragments.heads(
                itertools.chain.from_iterable(rows), lambda: itertools.chain.from_iterable(rows)
            )
        elif logprobs.top_ids is not None:
            self.table.check_ids(list(itertools.chain.from_iterable(logprobs.top_ids)))
        resolution = self.resolve(
            ids,
            logprobs.token_ids,
            logprobs.top_ids,
            context=context,
            final=final,
            top_ids_checked=True,
        )
        return fragments.content(logprobs, resolution, width, alt_heads), resolution.context


# --------------------------------------------------------------------------------------------
# JSON


_TOP_OPEN = b',"top_logprobs":['
_NO_TOP = b',"top_logprobs":[]},'
_ALT_SEP = b"},"
_ALT_END = b"}]},"


def _number_blob(values: Sequence[Any]) -> bytes:
    """orjson's text of a (nested) list of numbers; -inf / NaN (null) become -9999.0.

    Anything but numbers is a ``ValueError``: a string or bool would corrupt the splits.
    """
    blob = orjson.dumps(values)
    if any(mark in blob for mark in (b'"', b"{", b"t", b"f")):
        raise ValueError("logprobs must be numbers")
    if b"null" in blob:
        blob = blob.replace(b"null", b"-9999.0")
    return blob


def _literals(values: Sequence[float], closer: bytes) -> list[bytes]:
    """``<number><closer>`` for each value, from one orjson call and C string operations."""
    if not values:
        return []
    blob = _number_blob(values)[1:-1]
    if b"[" in blob:
        raise ValueError("logprobs must be numbers")
    pieces = (blob + b",").replace(b",", closer + b"\x00").split(b"\x00")
    pieces.pop()
    return pieces


def _row_literals(rows: Sequence[Sequence[float]], width: int) -> list[bytes]:
    """Row-major ``<number><closer>`` pieces of the alternatives' logprobs: ``},`` inside a
    row, ``}]},`` (closing the alternatives and the entry) at its end."""
    blob = _number_blob(rows)[2:-2]  # rows of equal width (checked), one number or more
    if blob.count(b"[") != len(rows) - 1:  # one "],[" between rows, no nested lists
        raise ValueError("logprobs must be numbers")
    # "a,b],[c" -> "a},\0b},\0]},\0[c" -> "a},\0b}]},\0c": ",": "},", row ends: "}]},".
    blob = blob.replace(b",", _ALT_SEP + b"\x00").replace(
        b"]" + _ALT_SEP + b"\x00[", _ALT_END + b"\x00"
    )
    pieces = (blob + _ALT_END).split(b"\x00")
    if len(pieces) != len(rows) * width:
        raise ValueError("logprobs must be numbers")
    return pieces


class _JsonFragments:
    """Per-id JSON heads, filled lazily: ``{"token":"abc","bytes":[97,98,99],"logprob":``.

    An entry is a head and a ``<number><closer>`` piece (closers are constants), so a whole
    response is one ``bytes.join`` over 2 parts per (position, alternative), with one table
    lookup each. ``logprob`` comes last in each object so that the number and what follows it
    form one piece (JSON key order carries no meaning).
    """

    def __init__(self, table: TokenTable) -> None:
        self.table = table
        self.head: dict[int, bytes] = {}
        self.custom: dict[str, bytes] = {}  # heads for texts that differ from the table's

    def _fill(self, ids: Iterable[int]) -> None:
        text, raw, head, size = self.table.text, self.table.raw, self.head, self.table.size
        for token_id in set(ids).difference(head):
            if type(token_id) is not int or not 0 <= token_id < size:
                raise ValueError(f"token id {token_id} is outside the vocabulary (size {size})")
            head[token_id] = _head(text[token_id], raw[token_id])

    def heads(
        self, ids: Iterable[int], again: Callable[[], Iterable[int]] | None = None
    ) -> list[bytes]:
        """Head of each id; ``ValueError`` for an id outside the vocabulary.

        ``ids`` may be a one-shot iterator; ``again`` then gives the ids a second time.
        """
        pieces = list(map(self.head.get, ids))
        if None in pieces:
            self._fill(again() if again is not None else ids)
            pieces = list(map(self.head.get, again() if again is not None else ids))
        return pieces  # type: ignore[return-value]

    def custom_head(self, token_id: int, text: str) -> bytes:
        key = f"{token_id}\x00{text}"
        piece = self.custom.get(key)
        if piece is None:
            if len(self.custom) > _CACHE_LIMIT:
                self.custom.clear()
            piece = self.custom[key] = _head(text, self.table.raw[token_id])
        return piece

    def content(
        self,
        logprobs: LogprobInput,
        resolution: _Resolution,
        width: int | None,
        alt_heads: list[bytes] | None,
    ) -> bytes:
        """The chat ``logprobs`` object: ``{"content":[...]}``.

        ``width``: alternatives per position (None when it varies); ``alt_heads``: heads of
        the alternatives in row-major order.
        """
        ids = logprobs.token_ids
        n = len(ids)
        if n == 0:
            return b'{"content":[]}'
        rows = logprobs.top_ids
        k = width
        if k is None:
            return b'{"content":[' + self._content_ragged(logprobs, resolution) + b"]}"
        stride = 2 * (1 + k)
        parts: list[bytes | None] = [None] * (stride * n)
        parts[0::stride] = self.heads(ids)
        parts[1::stride] = _literals(logprobs.logprobs, _TOP_OPEN if k else _NO_TOP)
        if k and alt_heads is not None and logprobs.top_logprobs is not None:
            # Row-major lists and strided slices: sequential C loops, no zip(*rows).
            literals = _row_literals(logprobs.top_logprobs, k)
            for rank in range(k):
                parts[2 + 2 * rank :: stride] = alt_heads[rank::k]
                parts[3 + 2 * rank :: stride] = literals[rank::k]
        custom = self.custom_head
        chosen_ids = logprobs.token_ids
        for position, piece in resolution.chosen.items():
            parts[position * stride] = custom(chosen_ids[position], piece)
        if rows is not None:
            for key, piece in resolution.top.items():
                position, rank = divmod(key, RANKS)
                parts[position * stride + 2 + 2 * rank] = custom(rows[position][rank], piece)
        first, last = parts[0], parts[-1]
        assert first is not None and last is not None
        parts[0] = b'{"content":[' + first
        parts[-1] = last[:-1] + b"]}"  # no comma after the last entry
        return b"".join(parts)  # type: ignore[arg-type]

    def _content_ragged(self, logprobs: LogprobInput, resolution: _Resolution) -> bytes:
        """Positions with different numbers of alternatives: build entry by entry."""
        text, raw = self.table.text, self.table.raw
        assert logprobs.top_ids is not None and logprobs.top_logprobs is not None
        numbers = itertools.chain(logprobs.logprobs, *logprobs.top_logprobs)
        if not set(map(type, numbers)) <= _NUMBER_TYPES:
            raise ValueError("logprobs must be numbers")
        entries = []
        pairs = zip(logprobs.token_ids, logprobs.logprobs, strict=True)
        for i, (token_id, logprob) in enumerate(pairs):
            top = [
                {
                    "token": resolution.top.get(i * RANKS + rank, text[alt]),
                    "logprob": _json_logprob(alt_lp),
                    "bytes": list(raw[alt]),
                }
                for rank, (alt, alt_lp) in enumerate(
                    zip(logprobs.top_ids[i], logprobs.top_logprobs[i], strict=True)
                )
            ]
            entries.append(
                {
                    "token": resolution.chosen.get(i, text[token_id]),
                    "logprob": _json_logprob(logprob),
                    "bytes": list(raw[token_id]),
                    "top_logprobs": top,
                }
            )
        return orjson.dumps(entries)[1:-1]


def _head(text: str, data: bytes) -> bytes:
    return (
        b'{"token":'
        + orjson.dumps(text)
        + b',"bytes":'
        + orjson.dumps(list(data))
        + (b',"logprob":')
    )


# --------------------------------------------------------------------------------------------
# Module-level conveniences


def _decoder(tokenizer: TokenizerLike) -> TokenTextDecoder:
    return TokenTextDecoder(tokenizer, token_table(tokenizer))


def resolve_logprob_tokens(
    tokenizer: TokenizerLike,
    token_ids: Sequence[int],
    entries: Iterable[LogprobEntry | Sequence[Any]] | LogprobInput,
    prompt_token_ids: Sequence[int] | None = None,
    *,
    final: bool = True,
) -> list[ResolvedLogprob]:
    """Text and bytes for every logprob entry of one choice (non-streaming)."""
    decoder = _decoder(tokenizer)
    logprobs = entries if isinstance(entries, LogprobInput) else LogprobInput.from_entries(entries)
    context = decoder.context_from_prompt(prompt_token_ids)
    resolved, _ = decoder.resolved(logprobs, token_ids, context=context, final=final)
    return resolved


def chat_logprobs_json(
    tokenizer: TokenizerLike,
    token_ids: Sequence[int],
    logprobs: LogprobInput,
    prompt_token_ids: Sequence[int] | None = None,
    *,
    final: bool = True,
) -> bytes:
    """The chat ``logprobs`` object (``{"content": [...]}``) of one choice as JSON bytes."""
    decoder = _decoder(tokenizer)
    context = decoder.context_from_prompt(prompt_token_ids)
    body, _ = decoder.chat_logprobs_json(logprobs, token_ids, context=context, final=final)
    return body
