"""/inference/v1/generate: token ids in, token ids and logprobs out; and aborting by id."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from tokenwire.engine.base import MultiModalInput
from tokenwire.pipeline.context import ModelRuntime, Pipeline
from tokenwire.pipeline.control import admit
from tokenwire.pipeline.decoder import PLAIN, ChoiceDecoder, DecodeOptions
from tokenwire.pipeline.jobs import ChoiceResult, GenerationJob, add_weight_span
from tokenwire.pipeline.logprobs import prompt_logprobs_json, token_logprobs_json
from tokenwire.pipeline.response_json import usage_json
from tokenwire.pipeline.validation import check_n, check_prompt
from tokenwire.protocol.generate import GenerateRequest, SamplingParamsModel


def start_job(
    pipeline: Pipeline,
    runtime: ModelRuntime,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParamsModel,
    media: MultiModalInput | None = None,
) -> GenerationJob:
    """Check the request against the model and register the job so it can be aborted by id."""
    admit(pipeline)
    check_n(pipeline.config, params.n)
    max_tokens = check_prompt(runtime, prompt_ids, params.max_tokens, param="token_ids")
    job = GenerationJob(
        runtime.engine,
        request_id,
        prompt_ids,
        params,
        max_tokens=max_tokens,
        media=media,
        stop_decoder=_stop_decoder(runtime, prompt_ids, params),
    )
    pipeline.jobs.add(job)
    return job


def _stop_decoder(
    runtime: ModelRuntime, prompt_ids: list[int], params: SamplingParamsModel
) -> Callable[[], ChoiceDecoder] | None:
    options = DecodeOptions.of(params)
    if not options.stop_strings:
        return None
    return lambda: ChoiceDecoder.start(
        runtime.decoder, runtime.eos_token_ids, options, PLAIN, prompt_ids
    )


class Generation:
    """One /inference/v1/generate call: answered whole or as chunks; unregistered at the end."""

    def __init__(self, pipeline: Pipeline, job: GenerationJob, body: GenerateRequest) -> None:
        self.pipeline = pipeline
        self.job = job
        self.body = body

    @property
    def request_id(self) -> str:
        return self.job.request_id

    async def response(self) -> dict[str, Any]:
        job = self.job
        try:
            results = await job.collect()
        finally:
            self.pipeline.jobs.remove(job)
        num_top = job.params.num_logprobs or 0
        return {
            "request_id": job.request_id,
            "model": self.pipeline.config.served_name,
            "created": int(time.time()),
            "usage": usage_json(
                len(job.prompt_ids),
                sum(len(r.token_ids) for r in results),
                job.num_cached_tokens,
            ),
            "choices": [_choice_json(result, num_top) for result in results],
            "prompt_logprobs": prompt_logprobs_json(job.prompt_ids, job.prompt_logprobs),
        }

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """One chunk per choice delta, then the usage chunk when asked for."""
        job = self.job
        options = self.body.stream_options
        include_usage = options is not None and options.include_usage
        continuous = options is not None and options.continuous_usage_stats
        num_top = job.params.num_logprobs or 0
        wants_logprobs = job.params.num_logprobs is not None
        prompt_tokens = len(job.prompt_ids)
        completion_tokens = 0
        # Per choice: (tokens so far, weight version spans), sent with its final chunk.
        produced = [0] * job.params.n
        spans: list[list[dict[str, Any]]] = [[] for _ in range(job.params.n)]
        try:
            async for delta in job.deltas():
                output = delta.output
                index = delta.index
                completion_tokens += len(output.new_token_ids)
                add_weight_span(spans[index], output, produced[index])
                produced[index] += len(output.new_token_ids)
                choice: dict[str, Any] = {
                    "index": index,
                    "token_ids": output.new_token_ids,
                    "logprobs": token_logprobs_json(output.logprobs or [], num_top)
                    if wants_logprobs
                    else None,
                    "finish_reason": output.finish_reason,
                    "stop_reason": output.stop_reason,
                }
                if output.finish_reason is not None:
                    choice["weight_versions"] = spans[index]
                chunk: dict[str, Any] = {"request_id": job.request_id, "choices": [choice]}
                if output.prompt_logprobs is not None:
                    chunk["prompt_logprobs"] = prompt_logprobs_json(
                        job.prompt_ids, output.prompt_logprobs
                    )
                if continuous:
                    chunk["usage"] = usage_json(prompt_tokens, completion_tokens)
                yield chunk
        finally:
            self.pipeline.jobs.remove(job)
        if include_usage:
            yield {
                "request_id": job.request_id,
                "choices": [],
                "usage": usage_json(prompt_tokens, completion_tokens, job.num_cached_tokens),
            }


async def start_generation(
    pipeline: Pipeline, body: GenerateRequest, request_id: str
) -> Generation:
    """Resolve the prompt's media, check the request and start its job."""
    runtime = pipeline.ready(body.model)
    if body.content_parts is not None:
        prompt = await runtime.media.prompt_from_content_parts(body.token_ids, body.content_parts)
    elif body.features is not None:
        prompt = await runtime.media.prompt_from_features(body.token_ids, body.features)
    else:
        prompt = None
    if prompt is None:
        prompt_ids, media = body.token_ids, None
    else:
        prompt_ids = prompt.token_ids
        media = prompt.engine_input() if prompt.items else None
    job = start_job(pipeline, runtime, request_id, prompt_ids, body.sampling_params, media)
    return Generation(pipeline, job, body)


def _choice_json(result: ChoiceResult, num_top: int) -> dict[str, Any]:
    return {
        "index": result.index,
        "token_ids": result.token_ids,
        "logprobs": None
        if result.logprobs is None
        else token_logprobs_json(result.logprobs, num_top),
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
        "weight_versions": result.weight_versions,
    }
