"""``<think>...</think>`` splitting as a resumable state machine, shared by the reasoning parsers.

Text arrives in pieces; the machine releases reasoning and content as soon as they are certain
and holds back only what could still change meaning (a partial tag, leading whitespace before
a possible ``<think>``). Feeding the whole text at once with ``finished=True`` is the
non-streaming parse, so streaming and non-streaming agree by construction.

Rules (API.md, then vLLM's qwen3 / deepseek_r1 parsers):

- Output that opens with ``<think>`` (after whitespace) is reasoning up to the first
  ``</think>``; the tag and the whitespace before it are dropped.
- A prompt that ends inside an open ``<think>`` block (``prompt_in_think``) makes the output
  reasoning from its first character.
- Reasoning without a closing ``</think>`` is truncated reasoning; nothing is content.
- Otherwise the text is content, tags included, except where a parser says that a ``</think>``
  without an opening one still closes reasoning (deepseek_r1: its template puts ``<think>`` in
  the prompt): the text before it is then reasoning. Such text is held until ``</think>`` or
  the end decides.
- Newlines around the tags are kept, as vLLM keeps them.
- qwen3 only: inside reasoning, ``<tool_call>`` followed by ``{`` or ``<function`` ends the
  reasoning implicitly (the call belongs to the content), as vLLM's qwen3 parser does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<tool_call>"
_CALL_STARTS = ("{", "<function")

# Phases of ThinkState.
START = "start"  # nothing decided yet (only whitespace or part of "<think>" seen)
THINK = "think"  # inside reasoning
MAYBE = "maybe"  # no opening tag; reasoning only if a "</think>" comes
CONTENT = "content"  # after reasoning, or no reasoning at all
PHASES = (START, THINK, MAYBE, CONTENT)


def prompt_ends_in_think(prompt_text: str) -> bool:
    """Whether the prompt leaves a ``<think>`` block open (R1 and Qwen3.5 templates end the
    prompt with ``<think>\\n``; ``enable_thinking=false`` closes it). A decoded tail of the
    prompt ids is enough."""
    opened = prompt_text.rfind(THINK_OPEN)
    return opened >= 0 and prompt_text.find(THINK_CLOSE, opened) < 0


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass(slots=True)
class ThinkState:
    """Serialisable progress of one choice through the think-tag machine."""

    phase: str = START
    held: str = ""
    prompt_in_think: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"phase": self.phase, "held": self.held, "pit": self.prompt_in_think}

    @classmethod
    def from_json(cls, data: Any) -> ThinkState:
        if not isinstance(data, dict):
            raise ValueError("reasoning state must be an object")
        phase, held, pit = data.get("phase"), data.get("held", ""), data.get("pit", False)
        if phase not in PHASES or not isinstance(held, str) or not isinstance(pit, bool):
            raise ValueError("bad reasoning state")
        return cls(phase, held, pit)


class ThinkTagParser:
    """A reasoning parser for ``<think>`` tags; subclasses pick the edge-case behaviour."""

    name = "think"
    #: A ``</think>`` with no opening tag still closes reasoning (text before it is reasoning).
    close_without_open: bool = False
    #: ``<tool_call>`` + ``{`` / ``<function`` ends open reasoning (qwen3).
    tool_call_ends_reasoning: bool = False

    def new_state(self, prompt_in_think: bool) -> ThinkState:
        return ThinkState(prompt_in_think=prompt_in_think)

    def feed(self, state: ThinkState, text: str, finished: bool) -> tuple[str, str]:
        """Consume ``text``; return the (reasoning, content) it releases. Mutates ``state``."""
        buf = state.held + text
        state.held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if state.phase == START:
                stripped = buf.lstrip()
                if stripped.startswith(THINK_OPEN):
                    buf = stripped[len(THINK_OPEN) :]
                    state.phase = THINK
                    continue
                if not finished and THINK_OPEN.startswith(stripped):
                    state.held = buf  # whitespace or part of "<think>": undecided
                    break
                if state.prompt_in_think:
                    state.phase = THINK
                elif self.close_without_open:
                    state.phase = MAYBE
                else:
                    state.phase = CONTENT
                continue
            if state.phase == CONTENT:
                content.append(buf)
                break
            # THINK or MAYBE: look for the end of the reasoning.
            end, resume, hold_from = self._reasoning_end(buf, state.phase, finished)
            if end >= 0:
                reasoning.append(buf[:end])
                buf = buf[resume:]
                state.phase = CONTENT
                continue
            if finished:
                (reasoning if state.phase == THINK else content).append(buf)
            elif state.phase == THINK:
                reasoning.append(buf[:hold_from])
                state.held = buf[hold_from:]
            else:
                state.held = buf  # MAYBE: nothing is certain until "</think>" or the end
            break
        return "".join(reasoning), "".join(content)

    def _reasoning_end(self, buf: str, phase: str, finished: bool) -> tuple[int, int, int]:
        """(end, resume, hold_from): where reasoning ends and content resumes, or -1 and how
        much of ``buf`` is certainly reasoning."""
        close = buf.find(THINK_CLOSE)
        limit = close if close >= 0 else len(buf)
        hold_from = len(buf) - partial_suffix(buf, THINK_CLOSE)
        if self.tool_call_ends_reasoning and phase == THINK:
            start = 0
            while (at := buf.find(TOOL_CALL_OPEN, start, limit)) >= 0:
                after = buf[at + len(TOOL_CALL_OPEN) :].lstrip()
                if after.startswith(_CALL_STARTS):
                    return at, at, at  # the call is content, tag included
                if not finished and (not after or any(s.startswith(after) for s in _CALL_STARTS)):
                    return -1, -1, min(at, hold_from)  # cannot tell yet
                start = at + 1
            if close < 0:
                hold_from = min(hold_from, len(buf) - partial_suffix(buf, TOOL_CALL_OPEN))
        if close >= 0:
            return close, close + len(THINK_CLOSE), close
        return -1, -1, hold_from
