"""``hermes`` tool parser: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

Used by Qwen2.5/Qwen3 and Hermes models; several blocks may follow each other. A block may
lack its closing tag at the end of the output (vLLM accepts ``<tool_call>(.*)$``). Unlike
vLLM, which turns the whole output back into content when any block is malformed, each block
stands alone here: a malformed block stays in the content as written and the valid ones are
calls. That keeps streaming append-only (a call once sent is never withdrawn) and loses no
text. ``"parameters"`` is accepted as an alias of ``"arguments"``.
"""

from __future__ import annotations

from .think import partial_suffix
from .tools import Released, ToolState, call_from_object, loads_json
from .types import ToolCall

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def parse_block(body: str) -> ToolCall | None:
    try:
        obj = loads_json(body)
    except ValueError:
        return None
    return call_from_object(obj, ("arguments", "parameters"))


class HermesToolParser:
    name = "hermes"

    def feed(self, state: ToolState, text: str, finished: bool) -> Released:
        """Consume content ``text``; return what it releases. Mutates ``state``."""
        out = Released(state)
        buf = state.held + text
        state.held = ""
        if state.mode == "start":
            state.mode = "text"
        while buf:
            if state.mode == "text":
                at = buf.find(OPEN)
                if at < 0:
                    keep = 0 if finished else partial_suffix(buf, OPEN)
                    out.text(buf[: len(buf) - keep])
                    state.held = buf[len(buf) - keep :]
                    break
                out.text(buf[:at])
                buf = buf[at:]
                state.mode = "block"
            end = buf.find(CLOSE, len(OPEN))
            if end < 0:
                if not finished:
                    state.held = buf  # an open call: wait for its end
                    break
                block, body, buf = buf, buf[len(OPEN) :], ""
            else:
                block, body = buf[: end + len(CLOSE)], buf[len(OPEN) : end]
                buf = buf[end + len(CLOSE) :]
            state.mode = "text"
            call = parse_block(body)
            if call is None:
                out.text(block)
            else:
                out.call(call)
        if finished:
            out.finish()
        return out
