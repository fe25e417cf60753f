"""Which parsers and decode options apply to a request's output, decided once per request."""

from __future__ import annotations

from collections.abc import Sequence

from tokenwire.parsers import ToolParser, prompt_ends_in_think
from tokenwire.parsers.think import THINK_CLOSE
from tokenwire.pipeline.chat_render import render_chat_text
from tokenwire.pipeline.context import ModelRuntime, Pipeline
from tokenwire.pipeline.decoder import PLAIN, Parsing
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.protocol.generate import ParseContext
from tokenwire.protocol.openai import ChatCompletionRequest
from tokenwire.structured.spec import Constraint, Reasoning
from tokenwire.structured.tool_choice import tool_calls_constraint, tool_forcing

# Enough prompt tail to see an open <think> however the template spells it.
_PROMPT_TAIL_TOKENS = 64


async def chat_parsing(
    pipeline: Pipeline,
    runtime: ModelRuntime,
    chat_request: ChatCompletionRequest | ParseContext | None,
    prompt_token_ids: Sequence[int] | None,
) -> Parsing:
    """Parsers need the chat request (or generate's ``parse_context``, its tools and tool
    choice): without one the output is plain content.

    Tool calls are parsed when the server has a tool parser, the request offers tools and its
    tool choice allows calls (auto needs ``--enable-auto-tool-choice``).
    """
    if chat_request is None:
        return PLAIN
    config = pipeline.config
    tool_choice = chat_request.tool_choice
    tools_enabled = bool(
        config.tool_parser is not None
        and chat_request.tools
        and tool_choice != "none"
        and (
            config.enable_auto_tool_choice
            or tool_choice == "required"
            or isinstance(tool_choice, dict)
        )
    )
    reasoning = config.reasoning_parser
    return Parsing(
        reasoning_parser=reasoning,
        tool_parser=config.tool_parser if tools_enabled else None,
        prompt_in_think=reasoning is not None
        and await _prompt_in_think(pipeline, runtime, chat_request, prompt_token_ids),
        forced_tools=_forced_tools(config.tool_parser if tools_enabled else None, chat_request),
    )


def _forced_tools(
    tool_parser: ToolParser | None, chat_request: ChatCompletionRequest | ParseContext
) -> Constraint | None:
    """The constraint a chat request's tool choice puts on its output (generate's
    ``parse_context`` only says how to parse: its sampling params say what to enforce)."""
    if not isinstance(chat_request, ChatCompletionRequest):
        return None
    try:
        forcing = tool_forcing(
            chat_request.tools, chat_request.tool_choice, chat_request.parallel_tool_calls
        )
        if forcing is None:
            return None
        if tool_parser is None:
            if forcing.at_least_one:
                raise ValueError(
                    "tool_choice forces a tool call, which needs a server started with "
                    "--tool-call-parser"
                )
            return None  # calls are not parsed: one or several, they are text
        return tool_calls_constraint(tool_parser.name, chat_request.tools or (), forcing)
    except ValueError as exc:
        raise InvalidRequest(str(exc), "tool_choice") from exc


async def _prompt_in_think(
    pipeline: Pipeline,
    runtime: ModelRuntime,
    chat_request: ChatCompletionRequest | ParseContext,
    prompt_token_ids: Sequence[int] | None,
) -> bool:
    if prompt_token_ids is None:
        if not isinstance(chat_request, ChatCompletionRequest):
            return False
        rendered = await render_chat_text(pipeline, runtime, chat_request, add_special_tokens=False)
        prompt_token_ids = rendered.token_ids
    return prompt_in_think(runtime, prompt_token_ids)


def prompt_in_think(runtime: ModelRuntime, prompt_token_ids: Sequence[int]) -> bool:
    """Whether the prompt leaves a ``<think>`` block open (its tail is enough)."""
    return prompt_ends_in_think(_tail(runtime, prompt_token_ids))


def reasoning_before_output(runtime: ModelRuntime, prompt_token_ids: Sequence[int]) -> Reasoning:
    """Where the model's reasoning stands when its output starts: inside a block the prompt
    opened ("open"), done (the prompt ends with a closed block, as Qwen3's template writes
    ``enable_thinking=false``: "none"), or not begun (the model may open one: "optional")."""
    tail = _tail(runtime, prompt_token_ids)
    if prompt_ends_in_think(tail):
        return "open"
    return "none" if tail.rstrip().endswith(THINK_CLOSE) else "optional"


def _tail(runtime: ModelRuntime, prompt_token_ids: Sequence[int]) -> str:
    return runtime.tokenizer.decode(list(prompt_token_ids[-_PROMPT_TAIL_TOKENS:]))
