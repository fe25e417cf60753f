"""The one per-choice decoder: a choice's output ids -> what the client reads.

Every path that turns output ids into text goes through ``ChoiceDecoder``: non-streaming and
streaming derender, the OpenAI routes streaming or not, and the generation job's stop-string
check. The rules live here once:

- the stop token that ended a choice (eos or a ``stop_token_ids`` hit, as ``stop_reason`` says)
  is in the ids and the logprobs but never in the text;
- ``skip_special_tokens`` drops special tokens from the text (logprob tokens keep them);
- a stop string cuts the text where it starts, or where it ends with
  ``include_stop_str_in_output`` (even inside a token); while streaming, text that may start a
  stop string is held back until it is known not to (vLLM does the same);
- the text decoder and the logprob-token decoder both start from the prompt's tail, so a
  character split between prompt and output is the same in both;
- reasoning is split first, then tool calls; a choice with parsed calls and tools enabled
  finishes with ``"tool_calls"``.

The state of a choice is small and JSON-serialisable, so a client can carry it between calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenwire.engine.stopping import StopReason, ends_with_stop_token
from tokenwire.parsers import (
    MessageDelta,
    ParseState,
    ReasoningParser,
    ToolParser,
    advance_text,
    new_parse_state,
)
from tokenwire.structured.spec import Constraint
from tokenwire.text.logprob_json import chat_logprobs_json_from, completion_logprobs_from
from tokenwire.text.token_table import DecodeContext
from tokenwire.text.token_text import LogprobInput, TokenTextDecoder


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    """What a request says about turning its ids into text."""

    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @classmethod
    def of(cls, request: Any | None) -> DecodeOptions:
        """From a chat/completion request or generate ``sampling_params``; None: the defaults."""
        if request is None:
            return cls()
        stop = request.stop
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        return cls(
            stop_token_ids=frozenset(request.stop_token_ids or ()),
            stop_strings=tuple(s for s in stops if s),
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
        )

    def to_json(self) -> list[Any]:
        return [
            sorted(self.stop_token_ids),
            list(self.stop_strings),
            self.include_stop_str_in_output,
            self.skip_special_tokens,
        ]

    @classmethod
    def from_json(cls, data: Any) -> DecodeOptions:
        """Parse what ``to_json`` wrote; ``ValueError`` for anything else (client input)."""
        stop_ids, stops, include, skip = data
        if not all(type(i) is int and i >= 0 for i in stop_ids):
            raise ValueError("stop token ids must be non-negative integers")
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        if not isinstance(include, bool) or not isinstance(skip, bool):
            raise ValueError("decode flags must be booleans")
        return cls(frozenset(stop_ids), tuple(stops), include, skip)


@dataclass(frozen=True, slots=True)
class Parsing:
    """Which parsers apply to one request's output; no parser: the text is the content."""

    reasoning_parser: ReasoningParser | None = None
    # Set only when tools are enabled for the request (offered, and tool choice allows calls).
    tool_parser: ToolParser | None = None
    # The prompt ends inside an open <think> block: the output starts as reasoning.
    prompt_in_think: bool = False
    # What the request's tool choice forces on the output, in the tool parser's call format
    # (``structured.tool_choice``); None: the model chooses.
    forced_tools: Constraint | None = None

    @property
    def tools_enabled(self) -> bool:
        return self.tool_parser is not None


PLAIN = Parsing()


@dataclass(slots=True)
class ChoiceState:
    """Where one choice stands; everything needed to continue it from another call."""

    logprob_context: DecodeContext = field(default_factory=DecodeContext)
    text_context: DecodeContext = field(default_factory=DecodeContext)
    held: str = ""  # text that may start a stop string, not yet emitted
    stop: str | None = None  # the stop string that ended the text; later text is dropped
    parse: ParseState = field(default_factory=ParseState)
    tool_calls: int = 0
    text_offset: int = 0  # characters of logprob-token text so far (completions' text_offset)
    tokens: int = 0
    started: bool = False
    finished: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "lp": self.logprob_context.to_json(),
            "tx": self.text_context.to_json(),
            "held": self.held,
            "stop": self.stop,
            "parse": self.parse.to_json(),
            "calls": self.tool_calls,
            "offset": self.text_offset,
            "n": self.tokens,
            "started": self.started,
            "done": self.finished,
        }

    @classmethod
    def from_json(cls, data: Any) -> ChoiceState:
        """Parse what ``to_json`` wrote; ``ValueError`` for anything else (client input)."""
        if not isinstance(data, dict):
            raise ValueError("choice state must be an object")
        counts = [data.get(name) for name in ("calls", "offset", "n")]
        if not all(type(count) is int and count >= 0 for count in counts):
            raise ValueError("choice state counters must be non-negative integers")
        flags = [data.get(name) for name in ("started", "done")]
        stop = data.get("stop")
        if (
            not all(isinstance(flag, bool) for flag in flags)
            or not isinstance(data.get("held"), str)
            or not (stop is None or isinstance(stop, str))
        ):
            raise ValueError("choice state is not valid")
        return cls(
            logprob_context=DecodeContext.from_json(data.get("lp")),
            text_context=DecodeContext.from_json(data.get("tx")),
            held=data["held"],
            stop=stop,
            parse=ParseState.from_json(data.get("parse")),
            tool_calls=data["calls"],
            text_offset=data["offset"],
            tokens=data["n"],
            started=data["started"],
            finished=data["done"],
        )


@dataclass(frozen=True, slots=True)
class ChoiceStep:
    """What one call added to a choice."""

    message: MessageDelta
    # The role goes on the first delta of a streamed chat choice.
    first: bool
    finish_reason: str | None
    # Chat logprobs (``{"content": [...]}`` as JSON bytes) or the completions shape.
    logprobs: bytes | dict[str, Any] | None

    @property
    def text(self) -> str:
        """The text a completion reads (no parsers run for completions)."""
        return self.message.content or ""


class ChoiceDecoder:
    """Decodes one choice, in one call or chunk by chunk."""

    def __init__(
        self,
        decoder: TokenTextDecoder,
        eos_token_ids: frozenset[int],
        options: DecodeOptions,
        parsing: Parsing,
        state: ChoiceState,
    ) -> None:
        self.decoder = decoder
        self.eos_token_ids = eos_token_ids
        self.options = options
        self.parsing = parsing
        self.state = state

    @classmethod
    def start(
        cls,
        decoder: TokenTextDecoder,
        eos_token_ids: frozenset[int],
        options: DecodeOptions,
        parsing: Parsing,
        prompt_token_ids: Sequence[int] | None,
    ) -> ChoiceDecoder:
        """A choice before its first token; the prompt's tail is both decoders' context."""
        context = decoder.context_from_prompt(prompt_token_ids)
        state = ChoiceState(
            logprob_context=context,
            text_context=context,
            parse=new_parse_state(prompt_in_think=parsing.prompt_in_think),
        )
        return cls(decoder, eos_token_ids, options, parsing, state)

    def step(
        self,
        token_ids: Sequence[int],
        *,
        finish_reason: str | None,
        stop_reason: StopReason = None,
        logprobs: LogprobInput | None = None,
        completion_logprobs: bool = False,
        final: bool | None = None,
    ) -> ChoiceStep:
        """Decode the next ids of a client's choice. ``final`` (default: a finish_reason came)
        flushes everything held back. ``ValueError`` for a client's inconsistent input."""
        final = finish_reason is not None if final is None else final
        ids = list(token_ids)
        self._check_open()
        text = self.text(self._text_ids(ids, finish_reason, stop_reason), final, stop_reason)
        return self.render(ids, text, finish_reason, logprobs, completion_logprobs, final)

    def cut(
        self, token_ids: Sequence[int], finish_reason: str | None, stop_reason: StopReason
    ) -> tuple[int, str]:
        """Decode a generation's next ids token by token, stopping at the one that completes a
        stop string: how many ids the choice keeps (that token included, as vLLM keeps it) and
        the visible text they add. Without stop strings the ids are decoded in one piece."""
        self._check_open()
        final = finish_reason is not None
        text_ids = self._text_ids(token_ids, finish_reason, stop_reason)
        if not self.options.stop_strings:
            return len(token_ids), self.text(text_ids, final)
        pieces = []
        for position, token_id in enumerate(text_ids):
            pieces.append(self.text([token_id], False))
            if self.state.stop is not None:
                return position + 1, "".join(pieces)
        if final:
            pieces.append(self.text((), True))
        return len(token_ids), "".join(pieces)

    def render(
        self,
        token_ids: Sequence[int],
        text: str,
        finish_reason: str | None,
        logprobs: LogprobInput | None = None,
        completion_logprobs: bool = False,
        final: bool | None = None,
    ) -> ChoiceStep:
        """What the client reads for ids whose visible ``text`` is known (``cut`` or ``text``):
        logprob token texts, reasoning and tool calls, and the finish reason."""
        state = self.state
        final = finish_reason is not None if final is None else final
        ids = list(token_ids)
        step_logprobs: bytes | dict[str, Any] | None = None
        if logprobs is not None and completion_logprobs:
            step_logprobs = self._completion_logprobs(logprobs, ids, final)
        elif logprobs is not None:
            step_logprobs, state.logprob_context = chat_logprobs_json_from(
                self.decoder, logprobs, ids, context=state.logprob_context, final=final
            )
        else:  # keep the logprob decoder in step for later chunks that do ask for logprobs
            state.logprob_context = self.decoder.advance(ids, state.logprob_context, final=final)
        message = advance_text(
            state.parse,
            text,
            finished=final,
            reasoning_parser=self.parsing.reasoning_parser,
            tool_parser=self.parsing.tool_parser,
            tools_enabled=self.parsing.tools_enabled,
        )
        state.tool_calls += len(message.tool_calls)
        state.tokens += len(ids)
        state.finished = final
        first = not state.started
        state.started = True
        if finish_reason is not None and state.tool_calls and self.parsing.tools_enabled:
            finish_reason = "tool_calls"
        return ChoiceStep(message, first, finish_reason, step_logprobs)

    def _check_open(self) -> None:
        if self.state.finished:
            raise ValueError("this choice's stream is already finished")

    def _text_ids(
        self, token_ids: Sequence[int], finish_reason: str | None, stop_reason: StopReason
    ) -> Sequence[int]:
        """The ids that make text: all but the stop token that ended the choice."""
        ends = ends_with_stop_token(
            token_ids,
            finish_reason,
            stop_reason,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=self.options.stop_token_ids,
        )
        return token_ids[:-1] if ends else token_ids

    def text(self, token_ids: Sequence[int], final: bool, stop_reason: StopReason = None) -> str:
        """The visible text these ids add: special tokens and stop strings applied."""
        state = self.state
        piece, state.text_context = self.decoder.decode_stream(
            token_ids,
            state.text_context,
            final=final,
            skip_special_tokens=self.options.skip_special_tokens,
        )
        stops = self.options.stop_strings
        if not stops:
            return piece
        if state.stop is not None:
            return ""
        text = state.held + piece
        found = _first_stop(text, stops, stop_reason)
        if found is not None:
            start, stop = found
            state.held, state.stop = "", stop
            end = start + len(stop) if self.options.include_stop_str_in_output else start
            return text[:end]
        keep = 0 if final else min(len(text), max(map(len, stops)) - 1)
        state.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, once one has."""
        return self.state.stop

    def _completion_logprobs(
        self, logprobs: LogprobInput, token_ids: list[int], final: bool
    ) -> dict[str, Any]:
        """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
        state = self.state
        result, state.logprob_context = completion_logprobs_from(
            self.decoder,
            logprobs,
            token_ids,
            context=state.logprob_context,
            final=final,
            text_offset=state.text_offset,
        )
        state.text_offset += sum(map(len, result["tokens"]))
        return result


def _first_stop(text: str, stops: Sequence[str], preferred: StopReason) -> tuple[int, str] | None:
    """The stop string that completes first in ``text`` (the engine's ``stop_reason`` wins)."""
    if isinstance(preferred, str) and preferred in stops:
        start = text.find(preferred)
        if start != -1:
            return start, preferred
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start != -1:
            key = (start + len(stop), -len(stop), stop)
            if best is None or key < best:
                best = key
    if best is None:
        return None
    end, _, stop = best
    return end - len(stop), stop
