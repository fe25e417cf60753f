"""Shared machinery of the tool-call parsers: resumable state, content release, JSON checks.

A tool parser reads the content stream (after the reasoning split) and returns the content it
releases and the calls it completed. Like the think-tag machine it only holds back what could
still change meaning, so a stream fed in any pieces gives the non-streaming result.

Content rules shared by every tool parser (vLLM's hermes behaviour):
- content that is only whitespace is dropped when the choice has tool calls (``"\\n\\n"``
  between ``</think>`` and ``<tool_call>``); it is held back until non-whitespace content or the
  end decides;
- otherwise content is kept as is, text between and after calls included;
- text that looks like a call but does not parse stays in the content, as written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .types import ToolCall

MODES = ("start", "text", "block", "region")


@dataclass(slots=True)
class ToolState:
    """Serialisable progress of one choice through a tool parser."""

    mode: str = "start"
    held: str = ""  # text whose meaning is not decided yet (partial tag, open call)
    ws: str = ""  # leading whitespace-only content, dropped if calls come and nothing else
    nonws: bool = False  # some non-whitespace content was released
    calls: int = 0  # calls released so far (the next call's index)

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "held": self.held, "ws": self.ws, "nonws": self.nonws,
                "calls": self.calls}  # fmt: skip

    @classmethod
    def from_json(cls, data: Any) -> ToolState:
        if not isinstance(data, dict):
            raise ValueError("tool state must be an object")
        state = cls(
            data.get("mode", "start"),
            data.get("held", ""),
            data.get("ws", ""),
            data.get("nonws", False),
            data.get("calls", 0),
        )
        if (
            state.mode not in MODES
            or not isinstance(state.held, str)
            or not isinstance(state.ws, str)
            or state.ws.strip()
            or not isinstance(state.nonws, bool)
            or type(state.calls) is not int
            or state.calls < 0
        ):
            raise ValueError("bad tool state")
        return state


class Released:
    """What one feed releases: content pieces and completed calls, in order."""

    __slots__ = ("calls", "content", "state")

    def __init__(self, state: ToolState) -> None:
        self.state = state
        self.content: list[str] = []
        self.calls: list[ToolCall] = []

    def text(self, piece: str) -> None:
        """Release content, holding whitespace-only content while nothing else was said."""
        if not piece:
            return
        state = self.state
        if state.nonws:
            self.content.append(piece)
        elif piece.isspace():
            state.ws += piece
        else:
            self.content.append(state.ws + piece)
            state.ws = ""
            state.nonws = True

    def call(self, call: ToolCall) -> None:
        self.calls.append(call)
        self.state.calls += 1

    def finish(self) -> None:
        """End of the choice: leading whitespace survives only if no call was made."""
        state = self.state
        if state.ws and not state.calls:
            self.content.append(state.ws)
        state.ws = ""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads_json(text: str) -> Any:
    """Strict JSON (no NaN/Infinity); ``ValueError`` for anything malformed, never more."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def arguments_json(value: Any) -> str:
    """The ``arguments`` string: a string that already holds JSON is kept, else JSON-encoded
    the way vLLM does (``json.dumps``, non-ASCII kept)."""
    if isinstance(value, str):
        try:
            loads_json(value)
        except ValueError:
            pass
        else:
            return value
    return json.dumps(value, ensure_ascii=False)


def call_from_object(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded envelope ``{"name": ..., <argument key>: ...}``, else None."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    for key in argument_keys:
        if key in obj:
            return ToolCall(name=name, arguments=arguments_json(obj[key]))
    return None
