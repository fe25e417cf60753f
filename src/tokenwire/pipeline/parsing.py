"""Which parsers and decode options apply to a request's output, decided once per request."""

from __future__ import annotations

from collections.abc import Sequence

from tokenwire.parsers import prompt_ends_in_think
from tokenwire.pipeline.chat_render import render_chat_text
from tokenwire.pipeline.context import ModelRuntime, Pipeline
from tokenwire.pipeline.decoder import PLAIN, Parsing
from tokenwire.protocol.generate import ParseContext
from tokenwire.protocol.openai import ChatCompletionRequest

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
    )


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
    tail = runtime.tokenizer.decode(list(prompt_token_ids[-_PROMPT_TAIL_TOKENS:]))
    return prompt_ends_in_think(tail)
