"""/tokenize and /detokenize: counting and inspecting tokens."""

from __future__ import annotations

from typing import Any

from tokenwire.pipeline.chat_render import render_chat
from tokenwire.pipeline.context import Pipeline
from tokenwire.pipeline.offload import run_text_work
from tokenwire.pipeline.validation import check_token_ids
from tokenwire.protocol.tokenize import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest


async def tokenize(pipeline: Pipeline, body: TokenizeRequest) -> dict[str, Any]:
    runtime = await pipeline.ready_without_job(body.model)
    tokenizer = runtime.tokenizer
    if isinstance(body, TokenizeChatRequest):
        rendered = await render_chat(
            pipeline, runtime, body, add_special_tokens=body.add_special_tokens
        )
        tokens = rendered.token_ids
    else:
        prompt, add_special = body.prompt, body.add_special_tokens
        tokens = await run_text_work(
            len(prompt), lambda: tokenizer.encode(prompt, add_special_tokens=add_special)
        )
    return {
        "count": len(tokens),
        "max_model_len": runtime.max_model_len,
        "tokens": tokens,
        "token_strs": tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None,
    }


async def detokenize(pipeline: Pipeline, body: DetokenizeRequest) -> dict[str, Any]:
    """Special tokens kept, as vLLM's /detokenize does."""
    runtime = await pipeline.ready_without_job(body.model)
    tokens = body.tokens
    check_token_ids(runtime, tokens, "tokens")
    prompt = await run_text_work(len(tokens) * 4, lambda: runtime.tokenizer.decode(tokens))
    return {"prompt": prompt}
