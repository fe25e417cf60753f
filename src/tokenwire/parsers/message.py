"""The assistant message from generated text: one code path for streaming and non-streaming.

Reasoning is split first (``<think>``), then tool calls are parsed from the content. Both
stages are resumable state machines, and the non-streaming result is the stream fed in one
piece, so a client that streams a choice token by token and joins the deltas gets exactly
the non-streaming message (content, reasoning, tool calls; ids aside).

The text given here is the decoded output with special tokens skipped and without the stop
token that ended the choice (Qwen3's ``<think>`` and ``<tool_call>`` are not special tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .registry import ReasoningParser, ToolParser, get_reasoning_parser, get_tool_parser
from .think import ThinkState
from .tools import ToolState
from .types import AssistantMessage, MessageDelta, ToolCallDelta


@dataclass(slots=True)
class ParseState:
    """Where one choice stands in both stages; small and JSON-serialisable."""

    think: ThinkState = field(default_factory=ThinkState)
    tools: ToolState = field(default_factory=ToolState)

    def to_json(self) -> dict[str, Any]:
        return {"think": self.think.to_json(), "tools": self.tools.to_json()}

    @classmethod
    def from_json(cls, data: Any) -> ParseState:
        """Parse what ``to_json`` wrote; ``ValueError`` for anything else (client input)."""
        if not isinstance(data, dict):
            raise ValueError("parse state must be an object")
        return cls(ThinkState.from_json(data.get("think")), ToolState.from_json(data.get("tools")))


def new_parse_state(*, prompt_in_think: bool = False) -> ParseState:
    """State for a new choice; ``prompt_in_think``: the prompt ends inside ``<think>``."""
    return ParseState(think=ThinkState(prompt_in_think=prompt_in_think))


def _reasoning(parser: ReasoningParser | str | None) -> ReasoningParser | None:
    return get_reasoning_parser(parser) if isinstance(parser, str) else parser


def _tools(parser: ToolParser | str | None) -> ToolParser | None:
    return get_tool_parser(parser) if isinstance(parser, str) else parser


def advance_text(
    state: ParseState,
    text: str,
    *,
    finished: bool,
    reasoning_parser: ReasoningParser | str | None,
    tool_parser: ToolParser | str | None,
    tools_enabled: bool,
) -> MessageDelta:
    """Feed the next piece of a choice's text; return what it adds. Mutates ``state``.

    ``finished=True`` on the last piece flushes everything held back.
    """
    reasoning_stage = _reasoning(reasoning_parser)
    tool_stage = _tools(tool_parser) if tools_enabled else None
    if reasoning_stage is None:
        reasoning, content = "", text
    else:
        reasoning, content = reasoning_stage.feed(state.think, text, finished)
    calls: list[ToolCallDelta] = []
    if tool_stage is not None:
        first_index = state.tools.calls
        released = tool_stage.feed(state.tools, content, finished)
        content = "".join(released.content)
        calls = [ToolCallDelta(first_index + i, call) for i, call in enumerate(released.calls)]
    return MessageDelta(content or None, reasoning or None, calls)


def build_assistant_message(
    text: str,
    *,
    reasoning_parser: ReasoningParser | str | None,
    tool_parser: ToolParser | str | None,
    tools_enabled: bool,
    prompt_in_think: bool = False,
) -> AssistantMessage:
    """The whole message of one choice (non-streaming derender)."""
    state = new_parse_state(prompt_in_think=prompt_in_think)
    delta = advance_text(
        state,
        text,
        finished=True,
        reasoning_parser=reasoning_parser,
        tool_parser=tool_parser,
        tools_enabled=tools_enabled,
    )
    return AssistantMessage(
        content=delta.content,
        reasoning_content=delta.reasoning_content,
        tool_calls=[item.call for item in delta.tool_calls],
    )
