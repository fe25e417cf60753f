"""``llama3_json`` tool parser: ``[<|python_tag|>]{"name": ..., "parameters": {...}}; {...}``.

Llama 3.x answers a tool turn with bare JSON envelopes separated by ``;`` (``"arguments"`` is
accepted too). Calls are recognised when the content starts with ``{`` or ``<|python_tag|>``,
or from a ``<|python_tag|>`` later in the text (prose before it stays content, as in vLLM's
newer parser). The region must be envelopes and separators only; otherwise all of it is
content, as written. The region is held until the end of the choice: a JSON answer that
merely starts with ``{`` cannot be told apart from a call any sooner.
"""

from __future__ import annotations

import json

from .think import partial_suffix
from .tools import Released, ToolState, call_from_object
from .types import ToolCall

PYTHON_TAG = "<|python_tag|>"


def _reject(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


_decoder = json.JSONDecoder(parse_constant=_reject)


def parse_region(region: str) -> list[ToolCall] | None:
    """Calls from ``[<|python_tag|>]obj (; obj)*``, or None if anything else is there."""
    text = region.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG) :]
    calls: list[ToolCall] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return calls or None
        try:
            obj, at = _decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        call = call_from_object(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        rest = text[at:].lstrip()
        if rest and not rest.startswith(";"):
            return None


class Llama3JsonToolParser:
    name = "llama3_json"

    def feed(self, state: ToolState, text: str, finished: bool) -> Released:
        """Consume content ``text``; return what it releases. Mutates ``state``."""
        out = Released(state)
        buf = state.held + text
        state.held = ""
        if state.mode == "start":
            head = buf.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                state.mode = "region"
            elif not finished and PYTHON_TAG.startswith(head):
                state.held = buf  # whitespace or part of the tag: undecided
                return out
            else:
                state.mode = "text"
        if state.mode == "text":
            at = buf.find(PYTHON_TAG)
            if at < 0:
                keep = 0 if finished else partial_suffix(buf, PYTHON_TAG)
                out.text(buf[: len(buf) - keep])
                state.held = buf[len(buf) - keep :]
            else:
                out.text(buf[:at])
                buf = buf[at:]
                state.mode = "region"
        if state.mode == "region":
            if not finished:
                state.held = buf
                return out
            calls = parse_region(buf)
            if calls is None:
                out.text(buf)
            else:
                for call in calls:
                    out.call(call)
        if finished:
            out.finish()
        return out
