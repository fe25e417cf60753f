"""tokenwire.parsers layer: reasoning and tool-call parsers on text, behind a registry."""

from .message import ParseState, advance_text, build_assistant_message, new_parse_state
from .registry import (
    REASONING_PARSER_NAMES,
    TOOL_PARSER_NAMES,
    ReasoningParser,
    ToolParser,
    get_reasoning_parser,
    get_tool_parser,
)
from .think import prompt_ends_in_think
from .types import AssistantMessage, MessageDelta, ToolCall, ToolCallDelta, make_tool_call_id

__all__ = [
    "REASONING_PARSER_NAMES",
    "TOOL_PARSER_NAMES",
    "AssistantMessage",
    "MessageDelta",
    "ParseState",
    "ReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "advance_text",
    "build_assistant_message",
    "get_reasoning_parser",
    "get_tool_parser",
    "make_tool_call_id",
    "new_parse_state",
    "prompt_ends_in_think",
]
