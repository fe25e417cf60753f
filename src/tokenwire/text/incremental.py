"""Streaming derender: one generate chunk at a time, with the state carried by the client.

The server keeps nothing between chunks. Everything a choice needs to continue is in
``StreamingDerenderState`` and travels as an opaque string: the pending bytes of an unfinished
character (two decoders: the logprob texts keep special tokens, the message text skips them),
the parsers' held-back text and counters. It stays small: held-back text is at most a partial
tag, whitespace, or an open tool call.

Guarantee: feeding a choice in any chunks and joining the deltas gives exactly the
non-streaming derender (content, reasoning, tool calls; tool-call ids aside), and the logprob
texts of all chunks are the non-streaming ones.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson

from ..parsers import (
    MessageDelta,
    ParseState,
    ReasoningParser,
    ToolParser,
    advance_text,
    new_parse_state,
)
from .logprob_json import chat_logprobs_json_from
from .token_table import DecodeContext, TokenizerLike, token_table
from .token_text import LogprobInput, TokenTextDecoder

STATE_VERSION = 1


@dataclass(slots=True)
class StreamingDerenderState:
    """Resumable derender state of one choice."""

    logprob_context: DecodeContext = field(default_factory=DecodeContext)
    text_context: DecodeContext = field(default_factory=DecodeContext)
    parse: ParseState = field(default_factory=ParseState)
    tokens: int = 0  # tokens consumed so far
    finished: bool = False

    def dumps(self) -> str:
        """The opaque string a client carries (URL-safe base64 of compact JSON)."""
        data = {
            "v": STATE_VERSION,
            "lp": self.logprob_context.to_json(),
            "tx": self.text_context.to_json(),
            "parse": self.parse.to_json(),
            "n": self.tokens,
            "done": self.finished,
        }
        return base64.urlsafe_b64encode(orjson.dumps(data)).decode("ascii").rstrip("=")

    @classmethod
    def loads(cls, blob: str) -> StreamingDerenderState:
        """Parse a client's state string; ``ValueError`` with a reason for anything else."""
        if not isinstance(blob, str):
            raise ValueError("derender state must be a string")
        try:
            raw = base64.urlsafe_b64decode(blob + "=" * (-len(blob) % 4))
            data = orjson.loads(raw)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"derender state is not valid: {exc}") from None
        if not isinstance(data, dict) or data.get("v") != STATE_VERSION:
            raise ValueError("derender state has an unknown version")
        tokens, done = data.get("n"), data.get("done")
        if type(tokens) is not int or tokens < 0 or not isinstance(done, bool):
            raise ValueError("derender state is not valid")
        return cls(
            DecodeContext.from_json(data.get("lp")),
            DecodeContext.from_json(data.get("tx")),
            ParseState.from_json(data.get("parse")),
            tokens,
            done,
        )


@dataclass(slots=True)
class DerenderDelta:
    """What one chunk adds: message delta, and its logprobs JSON (``{"content": [...]}``)."""

    message: MessageDelta
    logprobs_json: bytes | None = None


def start_stream(
    tokenizer: TokenizerLike,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    prompt_in_think: bool = False,
) -> StreamingDerenderState:
    """State before a choice's first token (the prompt's tail is the decoder context)."""
    decoder = TokenTextDecoder(tokenizer, token_table(tokenizer))
    return StreamingDerenderState(
        logprob_context=decoder.context_from_prompt(prompt_token_ids),
        parse=new_parse_state(prompt_in_think=prompt_in_think),
    )


def advance(
    tokenizer: TokenizerLike,
    state: StreamingDerenderState,
    token_ids: Sequence[int],
    *,
    finished: bool,
    reasoning_parser: ReasoningParser | str | None,
    tool_parser: ToolParser | str | None,
    tools_enabled: bool,
    logprobs: LogprobInput | None = None,
    drop_stop_token: bool = False,
) -> tuple[DerenderDelta, StreamingDerenderState]:
    """Derender the next chunk of a choice; ``state`` is not modified.

    ``drop_stop_token``: the last id of this (final) chunk is the stop token that ended the
    choice; it stays in the logprobs but not in the message text. ``ValueError`` for client
    mistakes (ids outside the vocabulary, a finished stream, mismatched logprobs).
    """
    if state.finished:
        raise ValueError("this choice's stream is already finished")
    decoder = TokenTextDecoder(tokenizer, token_table(tokenizer))
    ids = list(token_ids)
    new = StreamingDerenderState(
        state.logprob_context,
        state.text_context,
        ParseState.from_json(state.parse.to_json()),
        state.tokens + len(ids),
        finished,
    )
    logprobs_json = None
    if logprobs is not None:
        logprobs_json, new.logprob_context = chat_logprobs_json_from(
            decoder, logprobs, ids, context=state.logprob_context, final=finished
        )
    else:  # keep the logprob decoder in step for later chunks that do ask for logprobs
        new.logprob_context = decoder.resolve(
            ids, context=state.logprob_context, final=finished
        ).context
    text_ids = ids[:-1] if drop_stop_token and finished and ids else ids
    text, new.text_context = decoder.decode_stream(text_ids, state.text_context, final=finished)
    message = advance_text(
        new.parse,
        text,
        finished=finished,
        reasoning_parser=reasoning_parser,
        tool_parser=tool_parser,
        tools_enabled=tools_enabled,
    )
    return DerenderDelta(message, logprobs_json), new
