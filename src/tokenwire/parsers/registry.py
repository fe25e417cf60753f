"""Parsers by name, as ``--reasoning-parser`` and ``--tool-call-parser`` spell them."""

from __future__ import annotations

from typing import Protocol

from .deepseek_r1 import DeepSeekR1ReasoningParser
from .hermes import HermesToolParser
from .llama3_json import Llama3JsonToolParser
from .qwen3 import Qwen3ReasoningParser
from .think import ThinkState
from .tools import Released, ToolState


class ReasoningParser(Protocol):
    name: str

    def new_state(self, prompt_in_think: bool) -> ThinkState: ...

    def feed(self, state: ThinkState, text: str, finished: bool) -> tuple[str, str]: ...


class ToolParser(Protocol):
    name: str

    def feed(self, state: ToolState, text: str, finished: bool) -> Released: ...


_REASONING: dict[str, ReasoningParser] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser(), Qwen3ReasoningParser())
}
_TOOLS: dict[str, ToolParser] = {
    parser.name: parser for parser in (HermesToolParser(), Llama3JsonToolParser())
}

#: Names accepted by ``--reasoning-parser`` (for CLI validation).
REASONING_PARSER_NAMES: tuple[str, ...] = tuple(sorted(_REASONING))
#: Names accepted by ``--tool-call-parser``.
TOOL_PARSER_NAMES: tuple[str, ...] = tuple(sorted(_TOOLS))


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return _REASONING[name]
    except KeyError:
        choices = ", ".join(REASONING_PARSER_NAMES)
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of: {choices}") from None


def get_tool_parser(name: str) -> ToolParser:
    """The parser called ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return _TOOLS[name]
    except KeyError:
        choices = ", ".join(TOOL_PARSER_NAMES)
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of: {choices}") from None
