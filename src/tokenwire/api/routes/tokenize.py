"""POST /tokenize and POST /detokenize."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenwire.api.errors import bad_request
from tokenwire.api.offload import run_text_work
from tokenwire.api.rendering import render_chat_media
from tokenwire.api.responses import OrjsonResponse
from tokenwire.api.state import serving
from tokenwire.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)

router = APIRouter(tags=["tokenize"])


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    state, runtime = serving(request)
    state.check_model(body.model)
    tokenizer = runtime.tokenizer
    if isinstance(body, TokenizeChatRequest):
        rendered = await render_chat_media(
            state, runtime, body, add_special_tokens=body.add_special_tokens
        )
        tokens = rendered.token_ids
    else:
        prompt, add_special = body.prompt, body.add_special_tokens
        tokens = await run_text_work(
            len(prompt), lambda: tokenizer.encode(prompt, add_special_tokens=add_special)
        )
    token_strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return OrjsonResponse(
        {
            "count": len(tokens),
            "max_model_len": runtime.max_model_len,
            "tokens": tokens,
            "token_strs": token_strs,
        }
    )


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(
    body: DetokenizeRequest,
    request: Request,
) -> Response:
    state, runtime = serving(request)
    state.check_model(body.model)
    tokenizer = runtime.tokenizer
    for index, token_id in enumerate(body.tokens):
        if not tokenizer.is_valid_id(token_id):
            raise bad_request(
                f"tokens.{index}: token id {token_id} is outside the vocabulary "
                f"(0..{tokenizer.vocab_size - 1})",
                "tokens",
            )
    tokens = body.tokens
    prompt = await run_text_work(len(tokens) * 4, lambda: tokenizer.decode(tokens))
    return OrjsonResponse({"prompt": prompt})
