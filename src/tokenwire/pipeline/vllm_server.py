"""``/generate`` with vLLM's old demo-server body (atropos' ``VLLMServer``): generate's pipeline
underneath, answered in that server's shape: ``text``, ``prompt``, ``finish_reasons`` and, with
``logprobs``, per token ``[{token_id: logprob, ...}]`` (the sampled token first, which atropos
reads), ``prompt_token_ids`` and ``token_ids``; with ``prompt_logprobs``, per prompt position
``{token_id: logprob, ...}`` (None first), which atropos' ``get_logprobs`` reads."""

from __future__ import annotations

from typing import Any

from tokenwire.pipeline.context import Pipeline
from tokenwire.pipeline.offload import run_text_work
from tokenwire.protocol.generate import GenerateRequest
from tokenwire.protocol.vllm_server import VLLMServerGenerateRequest


def as_generate_request(body: VLLMServerGenerateRequest) -> GenerateRequest:
    """Generate's request: the body is its sampling params; ``text`` mode gives each choice's
    text as vLLM's output has it (special tokens skipped, cut at a stop string)."""
    return GenerateRequest(
        token_ids=body.prompt.prompt_token_ids, sampling_params=body, output_mode="text"
    )


async def vllm_server_answer(
    pipeline: Pipeline, body: VLLMServerGenerateRequest, generated: dict[str, Any]
) -> dict[str, Any]:
    """Generate's answer reshaped as that server's."""
    ids = body.prompt.prompt_token_ids
    tokenizer = pipeline.ready().tokenizer
    prompt = await run_text_work(len(ids) * 4, lambda: tokenizer.decode(ids))
    choices = generated["choices"]
    result: dict[str, Any] = {
        "text": [choice["text"] for choice in choices],
        "prompt": prompt,
        "finish_reasons": [choice["finish_reason"] for choice in choices],
    }
    if body.logprobs is not None:
        result["logprobs"] = [
            [
                [{str(alt["token_id"]): alt["logprob"] for alt in entry["top_logprobs"]}]
                for entry in choice["logprobs"]["content"]
            ]
            for choice in choices
        ]
        result["prompt_token_ids"] = ids
        result["token_ids"] = [choice["token_ids"] for choice in choices]
    positions = generated["prompt_logprobs"]
    if positions is not None:
        result["prompt_logprobs"] = [
            None if position is None else {k: v["logprob"] for k, v in position.items()}
            for position in positions
        ]
    return result
