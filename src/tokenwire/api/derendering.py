"""Output token ids -> OpenAI messages, text and byte-correct logprobs.

The one place that turns a choice's ids into what a client reads: /v1/chat/completions and
/v1/completions (streaming or not) and the derender endpoints all call these functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from tokenwire.api.errors import bad_request
from tokenwire.api.rendering import render_chat
from tokenwire.api.state import ModelRuntime, ServerState
from tokenwire.parsers import AssistantMessage, build_assistant_message, prompt_ends_in_think
from tokenwire.protocol.openai import ChatCompletionRequest
from tokenwire.text.logprob_json import chat_logprobs_json
from tokenwire.text.token_text import LogprobInput, resolve_logprob_tokens

# Enough prompt tail to see an open <think> however the template spells it.
_PROMPT_TAIL_TOKENS = 64


@dataclass(frozen=True, slots=True)
class ChatParsing:
    """Which parsers apply to one chat request's output."""

    reasoning_parser: str | None
    tool_parser: str | None
    tools_enabled: bool
    prompt_in_think: bool

    @property
    def is_plain(self) -> bool:
        return self.reasoning_parser is None and not self.tools_enabled


PLAIN = ChatParsing(None, None, False, False)


def chat_parsing(
    state: ServerState,
    runtime: ModelRuntime,
    chat_request: ChatCompletionRequest | None,
    prompt_token_ids: Sequence[int] | None,
) -> ChatParsing:
    """Parsers need the chat request: without one the output is plain content."""
    if chat_request is None:
        return PLAIN
    settings = state.settings
    tool_choice = chat_request.tool_choice
    tools_enabled = bool(
        settings.tool_call_parser
        and chat_request.tools
        and tool_choice != "none"
        and (
            settings.enable_auto_tool_choice
            or tool_choice == "required"
            or isinstance(tool_choice, dict)
        )
    )
    return ChatParsing(
        reasoning_parser=settings.reasoning_parser,
        tool_parser=settings.tool_call_parser if tools_enabled else None,
        tools_enabled=tools_enabled,
        prompt_in_think=bool(settings.reasoning_parser)
        and _prompt_in_think(state, runtime, chat_request, prompt_token_ids),
    )


def _prompt_in_think(
    state: ServerState,
    runtime: ModelRuntime,
    chat_request: ChatCompletionRequest,
    prompt_token_ids: Sequence[int] | None,
) -> bool:
    if prompt_token_ids is None:
        prompt_token_ids = render_chat(
            state, runtime, chat_request, add_special_tokens=False
        ).token_ids
    tail = runtime.tokenizer.decode(list(prompt_token_ids[-_PROMPT_TAIL_TOKENS:]))
    return prompt_ends_in_think(tail)


def check_output_ids(runtime: ModelRuntime, token_ids: Sequence[int], where: str) -> None:
    if len(token_ids) > runtime.max_model_len:
        raise bad_request(
            f"{where} has {len(token_ids)} token ids, more than max_model_len "
            f"({runtime.max_model_len})",
            "token_ids",
        )
    vocab_size = runtime.tokenizer.vocab_size
    for token_id in token_ids:
        if token_id >= vocab_size:
            raise bad_request(f"{where}: token id {token_id} is out of vocabulary", "token_ids")


def text_ids(
    runtime: ModelRuntime,
    token_ids: list[int],
    finish_reason: str | None,
    stop_token_ids: Sequence[int] = (),
) -> list[int]:
    """The ids whose text the client sees: the stop token that ended the choice is not text."""
    if (
        finish_reason == "stop"
        and token_ids
        and (token_ids[-1] in runtime.eos_token_ids or token_ids[-1] in stop_token_ids)
    ):
        return token_ids[:-1]
    return token_ids


def assistant_message(
    runtime: ModelRuntime, ids: list[int], parsing: ChatParsing
) -> AssistantMessage:
    text = runtime.tokenizer.decode(ids, skip_special_tokens=True)
    if parsing.is_plain:
        return AssistantMessage(content=text)
    return build_assistant_message(
        text,
        reasoning_parser=parsing.reasoning_parser,
        tool_parser=parsing.tool_parser,
        tools_enabled=parsing.tools_enabled,
        prompt_in_think=parsing.prompt_in_think,
    )


def chat_finish_reason(
    finish_reason: str | None, message: AssistantMessage, parsing: ChatParsing
) -> str | None:
    if message.tool_calls and parsing.tools_enabled:
        return "tool_calls"
    return finish_reason


def logprob_input(entries: Sequence[Any], token_ids: Sequence[int], where: str) -> LogprobInput:
    """Columns from parsed entries (each with token_id, logprob, top_logprobs)."""
    if len(entries) != len(token_ids):
        raise bad_request(
            f"{where} has {len(entries)} logprob entries for {len(token_ids)} token ids",
            "logprobs",
        )
    for position, (entry, token_id) in enumerate(zip(entries, token_ids, strict=True)):
        if entry.token_id != token_id:
            raise bad_request(
                f"{where}: logprob entry {position} is for token {entry.token_id}, "
                f"but the token there is {token_id}",
                "logprobs",
            )
    return LogprobInput(
        token_ids=[entry.token_id for entry in entries],
        logprobs=[entry.logprob for entry in entries],
        top_ids=[[top.token_id for top in entry.top_logprobs] for entry in entries],
        top_logprobs=[[top.logprob for top in entry.top_logprobs] for entry in entries],
    )


def chat_logprobs_fragment(
    runtime: ModelRuntime,
    token_ids: list[int],
    logprobs: LogprobInput,
    prompt_token_ids: Sequence[int] | None,
) -> orjson.Fragment:
    try:
        body = chat_logprobs_json(runtime.tokenizer, token_ids, logprobs, prompt_token_ids)
    except ValueError as exc:
        raise bad_request(str(exc), "logprobs") from exc
    return orjson.Fragment(body)


def completion_logprobs(
    runtime: ModelRuntime,
    token_ids: list[int],
    logprobs: LogprobInput,
    prompt_token_ids: Sequence[int] | None,
) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    try:
        resolved = resolve_logprob_tokens(runtime.tokenizer, token_ids, logprobs, prompt_token_ids)
    except ValueError as exc:
        raise bad_request(str(exc), "logprobs") from exc
    offsets = []
    offset = 0
    for token in resolved:
        offsets.append(offset)
        offset += len(token.text)
    return {
        "tokens": [token.text for token in resolved],
        "token_logprobs": [token.logprob for token in resolved],
        "top_logprobs": [{alt.text: alt.logprob for alt in token.top} for token in resolved],
        "text_offset": offsets,
    }
