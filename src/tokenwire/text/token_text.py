"""Exact text of each token of an output, and incremental decoding of a token stream.

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

The decoder state between tokens (``DecodeContext``) is small, so a stream can be resumed from
it; the first output tokens take that state from the tail of the prompt. Cost is O(n): texts
come from the per-id ``TokenTable`` and only tokens next to a split character go through a real
decoder. Tokenizers whose decoder is not a plain byte concatenation take a fallback: each token
is decoded with up to 4 preceding tokens of context and a character that is still incomplete is
held back. The JSON form of the results is ``logprob_json``'s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .token_table import (
    CACHE_LIMIT,
    CONTEXT_TOKENS,
    DecodeContext,
    TokenizerLike,
    TokenTable,
    feed,
    pending_after,
    token_table,
)

__all__ = [
    "NON_FINITE_LOGPROB",
    "LogprobEntry",
    "LogprobInput",
    "Resolution",
    "ResolvedLogprob",
    "ResolvedToken",
    "TokenTextDecoder",
    "json_logprob",
    "resolve_logprob_tokens",
]

#: Logprob placed in JSON for -inf / NaN (JSON has neither).
NON_FINITE_LOGPROB = -9999.0

_NUMBER_TYPES = {int, float}


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

    def with_top_width(self, width: int) -> LogprobInput:
        """The same logprobs with at most ``width`` alternatives per position."""
        if self.top_ids is None or all(len(row) <= width for row in self.top_ids):
            return self
        return LogprobInput(
            self.token_ids,
            self.logprobs,
            [row[:width] for row in self.top_ids],
            [row[:width] for row in self.top_logprobs or ()],
        )

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
        return (widths.pop() if widths else 0) if len(widths) <= 1 else None

    def check_numbers(self) -> None:
        """Raise ``ValueError`` unless every logprob is an int or a float (client input).

        The JSON path for uniform rows skips this walk: it checks numbers as it encodes them.
        """
        numbers = itertools.chain(self.logprobs, *(self.top_logprobs or ()))
        if not set(map(type, numbers)) <= _NUMBER_TYPES:
            raise ValueError("logprobs must be numbers")


@dataclass(slots=True)
class ResolvedToken:
    token_id: int
    text: str
    bytes: list[int]
    logprob: float

    def to_json(self) -> dict[str, Any]:
        return {"token": self.text, "logprob": json_logprob(self.logprob), "bytes": self.bytes}


@dataclass(slots=True)
class ResolvedLogprob(ResolvedToken):
    top: list[ResolvedToken] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = ResolvedToken.to_json(self)
        data["top_logprobs"] = [alt.to_json() for alt in self.top]
        return data


def json_logprob(value: float) -> float:
    """``value`` as JSON can hold it: -inf and NaN become ``NON_FINITE_LOGPROB``."""
    return value if math.isfinite(value) else NON_FINITE_LOGPROB


def _top_key(position: int, rank: int, positions: int) -> int:
    """``Resolution.top``'s key: an int keeps the dict out of the garbage collector's way, and
    rank-major order puts no bound on a row's width (``--max-logprobs -1``: the vocabulary)."""
    return rank * positions + position


class Resolution(NamedTuple):
    """Texts that differ from ``TokenTable.text`` (rare), and the state after the last token.

    ``top`` is keyed by ``_top_key``; ``top_text`` and ``top_items`` read it. ``positions``:
    how many positions were resolved.
    """

    chosen: dict[int, str]
    top: dict[int, str]
    context: DecodeContext
    positions: int

    def top_text(self, position: int, rank: int, default: str) -> str:
        """The text of the alternative at ``rank`` of ``position``; ``default`` (the table's
        text) unless it differs."""
        return self.top.get(_top_key(position, rank, self.positions), default)

    def top_items(self) -> Iterator[tuple[int, int, str]]:
        """(position, rank, text) of each alternative whose text differs from the table's."""
        for key, text in self.top.items():
            rank, position = divmod(key, self.positions)
            yield position, rank, text


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
                pending=pending_after(b"".join(map(self.table.raw.__getitem__, tail)))
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
    ) -> Resolution:
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

    def advance(
        self, token_ids: Sequence[int], context: DecodeContext, *, final: bool
    ) -> DecodeContext:
        """The state ``resolve`` would end in, without resolving any text (a chunk whose
        logprobs nobody asked for, kept in step for later chunks that do)."""
        if not self.table.exact:
            return self.resolve(token_ids, context=context, final=final).context
        self.table.check_ids(token_ids)
        if final and token_ids:
            return DecodeContext()
        # A pending character is at most 3 bytes, so the last 4 bytes decide it.
        raw = self.table.raw
        tail = b""
        for token_id in reversed(token_ids):
            tail = raw[token_id] + tail
            if len(tail) >= 4:
                break
        else:
            tail = context.pending + tail
        return DecodeContext(pending=pending_after(tail))

    # -- byte-level tables ------------------------------------------------------------------

    def _resolve_bytes(
        self,
        ids: Sequence[int],
        chosen_ids: Sequence[int] | None,
        top_ids: Sequence[Sequence[int]] | None,
        pending: bytes,
        final: bool,
    ) -> Resolution:
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
            piece, pending = feed(pending + raw[token_id], False)
            if piece != text[token_id]:
                chosen[i] = piece
            i += 1
            if not pending:
                i = flags.find(0, i)
        last = n - 1
        if final and pending and n:
            chosen[last] = chosen.get(last, text[ids[last]]) + feed(pending, True)[0]
            pending = b""

        def alternative(position: int, token_id: int) -> str | None:
            """Text of ``token_id`` at ``position``, or None when it equals the table text."""
            flush = final and position == last
            prior = before.get(position, b"")
            if not prior and not flush:
                return None
            piece, rest = feed(prior + raw[token_id], False)
            if flush and rest:
                piece += feed(rest, True)[0]
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
            if len(cache) > CACHE_LIMIT:
                cache.clear()
            for position, prior in before.items():
                if final and position == last:
                    continue
                tag = int.from_bytes(prior, "big")  # a lead byte first: never 0, so unique
                for rank, token_id in enumerate(top_ids[position]):
                    key = token_id << 24 | tag
                    piece = cache.get(key)
                    if piece is None:
                        piece = cache[key] = feed(prior + raw[token_id], False)[0]
                    if piece != text[token_id]:
                        top[_top_key(position, rank, n)] = piece
            if final and n:
                for rank, token_id in enumerate(top_ids[last]):
                    piece = alternative(last, token_id)
                    if piece is not None:
                        top[_top_key(last, rank, n)] = piece
        return Resolution(chosen, top, DecodeContext(pending=pending), n)

    # -- fallback: decode with context ------------------------------------------------------

    def _resolve_fallback(
        self,
        ids: Sequence[int],
        chosen_ids: Sequence[int] | None,
        top_ids: Sequence[Sequence[int]] | None,
        context: DecodeContext,
        final: bool,
    ) -> Resolution:
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
                        top[_top_key(i, rank, n)] = alt_piece
            if piece or flush:
                ctx = [*window, token_id][-CONTEXT_TOKENS:]
                held = []
            else:
                held.append(token_id)
        return Resolution(chosen, top, DecodeContext(context=tuple(ctx), held=tuple(held)), n)

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
            piece, pending = feed(data, final)
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
        logprobs.check_numbers()
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
                    alt_text = resolution.top_text(i, rank, text[alt])
                    top.append(ResolvedToken(alt, alt_text, list(raw[alt]), alt_lp))
            chosen_text = resolution.chosen.get(i, text[token_id])
            out.append(ResolvedLogprob(token_id, chosen_text, list(raw[token_id]), logprob, top))
        return out, resolution.context


def resolve_logprob_tokens(
    tokenizer: TokenizerLike,
    token_ids: Sequence[int],
    entries: Iterable[LogprobEntry | Sequence[Any]] | LogprobInput,
    prompt_token_ids: Sequence[int] | None = None,
    *,
    final: bool = True,
) -> list[ResolvedLogprob]:
    """Text and bytes for every logprob entry of one choice (non-streaming)."""
    decoder = TokenTextDecoder(tokenizer)
    logprobs = entries if isinstance(entries, LogprobInput) else LogprobInput.from_entries(entries)
    context = decoder.context_from_prompt(prompt_token_ids)
    resolved, _ = decoder.resolved(logprobs, token_ids, context=context, final=final)
    return resolved
