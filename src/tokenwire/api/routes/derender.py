"""POST /v1/chat/completions/derender and /v1/completions/derender: output ids -> responses."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenwire.api.derendering import assistant_message as build_message
from tokenwire.api.derendering import (
    chat_finish_reason,
    chat_logprobs_fragment,
    chat_parsing,
    check_output_ids,
    completion_logprobs,
    logprob_input,
    text_ids,
)
from tokenwire.api.errors import bad_request
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.state import ModelRuntime, serving
from tokenwire.api.streaming_derender import derender_chunk
from tokenwire.api.streams import usage_json
from tokenwire.protocol.derender import (
    ChatDerenderBody,
    ChatDerenderStreamRequest,
    CompletionDerenderRequest,
    GenerateChoiceIn,
)

router = APIRouter(tags=["derender"])


@router.post("/v1/chat/completions/derender")
async def derender_chat(
    body: ChatDerenderBody,
    request: Request,
) -> Response:
    state, runtime = serving(request)
    state.check_model(body.model)
    if isinstance(body, ChatDerenderStreamRequest):
        return OrjsonResponse(derender_chunk(state, runtime, body))
    chat = body.chat_request
    parsing = chat_parsing(state, runtime, chat, body.prompt_token_ids)
    stop_ids = (chat.stop_token_ids or []) if chat else []
    response = body.generate_response
    choices = []
    completion_tokens = 0
    for position, choice in enumerate(response.choices):
        ids = choice_ids(runtime, choice, position)
        completion_tokens += len(ids)
        message = build_message(
            runtime, text_ids(runtime, ids, choice.finish_reason, stop_ids), parsing
        )
        logprobs = None
        if choice.logprobs is not None and choice.logprobs.content is not None:
            columns = logprob_input(choice.logprobs.content, ids, f"choice {position}")
            logprobs = chat_logprobs_fragment(runtime, ids, columns, body.prompt_token_ids)
        choices.append(
            {
                "index": choice.index,
                "message": message.to_json(),
                "logprobs": logprobs,
                "finish_reason": chat_finish_reason(choice.finish_reason, message, parsing),
            }
        )
    prompt_tokens = body.prompt_tokens
    if prompt_tokens is None:
        prompt_tokens = len(body.prompt_token_ids or ())
    return OrjsonResponse(
        {
            "id": response.request_id,
            "object": "chat.completion",
            "created": response.created or int(time.time()),
            "model": state.served_name,
            "choices": choices,
            "usage": usage_json(prompt_tokens, completion_tokens),
        }
    )


def choice_ids(runtime: ModelRuntime, choice: GenerateChoiceIn, position: int) -> list[int]:
    if not choice.token_ids:
        raise bad_request(f"choice {position} has empty or null token_ids", "token_ids")
    check_output_ids(runtime, choice.token_ids, f"choice {position}")
    return choice.token_ids


@router.post("/v1/completions/derender")
async def derender_completion(body: CompletionDerenderRequest, request: Request) -> Response:
    state, runtime = serving(request)
    state.check_model(body.model)
    request = body.completion_request
    stop_ids = (request.stop_token_ids or []) if request else []
    choices: list[dict[str, Any]] = []
    prompt_total = 0
    completion_tokens = 0
    for response_index, response in enumerate(body.generate_responses):
        prompt_ids = body.prompt_token_ids[response_index] if body.prompt_token_ids else None
        if body.prompt_tokens is not None:
            prompt_total += body.prompt_tokens[response_index]
        elif prompt_ids is not None:
            prompt_total += len(prompt_ids)
        for position, choice in enumerate(response.choices):
            ids = choice_ids(runtime, choice, position)
            completion_tokens += len(ids)
            visible = text_ids(runtime, ids, choice.finish_reason, stop_ids)
            logprobs = None
            if choice.logprobs is not None and choice.logprobs.content is not None:
                columns = logprob_input(choice.logprobs.content, ids, f"choice {position}")
                logprobs = completion_logprobs(runtime, ids, columns, prompt_ids)
            choices.append(
                {
                    "index": len(choices),
                    "text": runtime.tokenizer.decode(visible, skip_special_tokens=True),
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                }
            )
    first = body.generate_responses[0]
    return OrjsonResponse(
        {
            "id": first.request_id,
            "object": "text_completion",
            "created": first.created or int(time.time()),
            "model": state.served_name,
            "choices": choices,
            "usage": usage_json(prompt_total, completion_tokens),
        }
    )
