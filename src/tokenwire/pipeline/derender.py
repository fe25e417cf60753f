"""Derender: output ids of /inference/v1/generate -> chat and completion responses.

Each choice goes through its own ``ChoiceDecoder`` in one call; the streaming form is in
``stream_derender``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson

from tokenwire.parsers import AssistantMessage
from tokenwire.pipeline.context import ModelRuntime, Pipeline
from tokenwire.pipeline.decoder import ChoiceDecoder, ChoiceStep, DecodeOptions, Parsing
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.pipeline.offload import run_text_work
from tokenwire.pipeline.parsing import chat_parsing
from tokenwire.pipeline.response_json import completion_json
from tokenwire.pipeline.validation import check_output_ids, logprob_columns
from tokenwire.protocol.derender import (
    ChatDerenderRequest,
    CompletionDerenderRequest,
    GenerateChoiceIn,
)
from tokenwire.text.token_text import LogprobInput


def decode_choice(
    runtime: ModelRuntime,
    choice: GenerateChoiceIn,
    position: int,
    options: DecodeOptions,
    parsing: Parsing,
    prompt_token_ids: Sequence[int] | None,
    *,
    completion_logprobs: bool = False,
    decoder: ChoiceDecoder | None = None,
    final: bool = True,
    top_width: int | None = None,
) -> ChoiceStep:
    """One client-sent choice (or chunk of one) through its decoder, checked first.

    ``top_width``: the alternatives the original request asked for (None: as sent). Generate
    lists at least the sampled token; a request for none shows none, as the OpenAI routes do.
    """
    where = f"choice {position}"
    ids = choice.token_ids or []
    if final or ids:
        check_output_ids(runtime, ids, where)
    logprobs: LogprobInput | None = None
    if choice.logprobs is not None and choice.logprobs.content is not None:
        logprobs = logprob_columns(choice.logprobs.content, ids, where)
        if top_width is not None:
            logprobs = logprobs.with_top_width(top_width)
    try:
        if decoder is None:
            decoder = ChoiceDecoder.start(
                runtime.decoder, runtime.eos_token_ids, options, parsing, prompt_token_ids
            )
        return decoder.step(
            ids,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            logprobs=logprobs,
            completion_logprobs=completion_logprobs,
            final=True if final else None,
        )
    except ValueError as exc:
        raise InvalidRequest(f"{where}: {exc}", "logprobs") from exc


def work_size(choices: Sequence[GenerateChoiceIn]) -> int:
    """The decode work of ``choices`` in ``run_text_work``'s units (about a character of
    tokenising each): a logprob entry costs several times what its id alone does."""
    size = 0
    for choice in choices:
        size += 4 * len(choice.token_ids or ())
        content = choice.logprobs.content if choice.logprobs is not None else None
        if content:
            first = content[0]
            top = first.get("top_logprobs") if isinstance(first, dict) else None
            size += 16 * len(content) * (1 + (len(top) if isinstance(top, list) else 0))
    return size


def message_json(step: ChoiceStep) -> dict[str, Any]:
    """A whole choice's assistant message (``step`` of a decoder fed in one piece)."""
    delta = step.message
    message = AssistantMessage(
        content=delta.content,
        reasoning_content=delta.reasoning_content,
        tool_calls=[item.call for item in delta.tool_calls],
    )
    return message.to_json()


def logprobs_fragment(step: ChoiceStep) -> orjson.Fragment | None:
    return orjson.Fragment(step.logprobs) if isinstance(step.logprobs, bytes) else None


async def derender_chat(pipeline: Pipeline, body: ChatDerenderRequest) -> dict[str, Any]:
    runtime = pipeline.ready(body.model)
    chat = body.chat_request
    parsing = await chat_parsing(pipeline, runtime, chat, body.prompt_token_ids)
    options = DecodeOptions.of(chat)
    response = body.generate_response

    def decode_all() -> list[dict[str, Any]]:
        choices = []
        for position, choice in enumerate(response.choices):
            step = decode_choice(
                runtime,
                choice,
                position,
                options,
                parsing,
                body.prompt_token_ids,
                top_width=chat.num_logprobs if chat is not None else None,
            )
            choices.append(
                {
                    "index": choice.index,
                    "message": message_json(step),
                    "logprobs": logprobs_fragment(step),
                    "finish_reason": step.finish_reason,
                }
            )
        return choices

    choices = await run_text_work(work_size(response.choices), decode_all)
    completion_tokens = sum(len(choice.token_ids or ()) for choice in response.choices)
    prompt_tokens = body.prompt_tokens
    if prompt_tokens is None:
        prompt_tokens = len(body.prompt_token_ids or ())
    return completion_json(
        response_id=response.request_id,
        kind="chat.completion",
        created=response.created or int(time.time()),
        model=pipeline.config.served_name,
        choices=choices,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )


async def derender_completion(
    pipeline: Pipeline, body: CompletionDerenderRequest
) -> dict[str, Any]:
    runtime = pipeline.ready(body.model)
    request = body.completion_request
    options = DecodeOptions.of(request)
    prompt_total = 0
    completion_tokens = 0
    for response_index, response in enumerate(body.generate_responses):
        prompt_ids = body.prompt_token_ids[response_index] if body.prompt_token_ids else None
        if body.prompt_tokens is not None:
            prompt_total += body.prompt_tokens[response_index]
        elif prompt_ids is not None:
            prompt_total += len(prompt_ids)
        completion_tokens += sum(len(choice.token_ids or ()) for choice in response.choices)

    def decode_all() -> list[dict[str, Any]]:
        choices: list[dict[str, Any]] = []
        for response_index, response in enumerate(body.generate_responses):
            prompt_ids = body.prompt_token_ids[response_index] if body.prompt_token_ids else None
            for position, choice in enumerate(response.choices):
                step = decode_choice(
                    runtime,
                    choice,
                    position,
                    options,
                    Parsing(),
                    prompt_ids,
                    completion_logprobs=True,
                    top_width=request.logprobs if request is not None else None,
                )
                choices.append(
                    {
                        "index": len(choices),
                        "text": step.text,
                        "logprobs": step.logprobs,
                        "finish_reason": choice.finish_reason,
                    }
                )
        return choices

    size = sum(work_size(response.choices) for response in body.generate_responses)
    choices = await run_text_work(size, decode_all)
    first = body.generate_responses[0]
    return completion_json(
        response_id=first.request_id,
        kind="text_completion",
        created=first.created or int(time.time()),
        model=pipeline.config.served_name,
        choices=choices,
        prompt_tokens=prompt_total,
        completion_tokens=completion_tokens,
    )
