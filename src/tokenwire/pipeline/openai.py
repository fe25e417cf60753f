"""OpenAI-compatible chat completions and completions: render -> generate -> derender.

Each step is the function the token-level endpoints use (``render``, ``generate.start_job``,
``ChoiceDecoder``), so a chat completion and the three calls made one by one give identical
tokens and text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from tokenwire.engine.base import EngineOutput
from tokenwire.pipeline.context import ModelRuntime, Pipeline
from tokenwire.pipeline.decoder import PLAIN, ChoiceDecoder, ChoiceStep, DecodeOptions, Parsing
from tokenwire.pipeline.derender import logprobs_fragment, message_json
from tokenwire.pipeline.generate import start_job
from tokenwire.pipeline.jobs import GenerationJob, merge
from tokenwire.pipeline.logprobs import engine_logprob_columns
from tokenwire.pipeline.parsing import chat_parsing
from tokenwire.pipeline.render import chat_prompt, completion_prompts
from tokenwire.pipeline.response_json import completion_json, usage_json
from tokenwire.pipeline.stream_derender import chat_chunk_choice
from tokenwire.protocol.generate import StreamOptions
from tokenwire.protocol.openai import ChatCompletionRequest, CompletionRequest


class CompletionRun:
    """The jobs of one OpenAI request and how to turn their outputs into choices.

    ``num_logprobs``: alternatives per token, None when the request wants no logprobs. Every
    choice gets its own ``ChoiceDecoder``; ``choice_json`` turns one decoder step into the
    response's (or chunk's) choice object.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        runtime: ModelRuntime,
        jobs: list[GenerationJob],
        *,
        kind: str,
        options: DecodeOptions,
        parsing: Parsing,
        num_logprobs: int | None,
        stream_options: StreamOptions | None,
    ) -> None:
        self.pipeline = pipeline
        self.runtime = runtime
        self.jobs = jobs
        self.kind = kind
        self.options = options
        self.parsing = parsing
        self.num_logprobs = num_logprobs
        self.stream_options = stream_options
        self.created = int(time.time())
        first = jobs[0].request_id
        self.id = first if len(jobs) == 1 else first.rsplit("-", 1)[0]
        self.n = jobs[0].params.n

    @property
    def is_chat(self) -> bool:
        return self.kind == "chat.completion"

    def _decoder(self, job: GenerationJob) -> ChoiceDecoder:
        runtime = self.runtime
        return ChoiceDecoder.start(
            runtime.decoder, runtime.eos_token_ids, self.options, self.parsing, job.prompt_ids
        )

    def _step(self, decoder: ChoiceDecoder, output: EngineOutput, *, final: bool) -> ChoiceStep:
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = engine_logprob_columns(output.logprobs or [], self.num_logprobs)
        return decoder.step(
            output.new_token_ids,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            logprobs=logprobs,
            completion_logprobs=not self.is_chat,
            final=final or None,
        )

    async def response(self) -> dict[str, Any]:
        try:
            per_job = await asyncio.gather(*(job.collect() for job in self.jobs))
        finally:
            self.pipeline.jobs.remove(*self.jobs)
        choices: list[dict[str, Any]] = []
        completion_tokens = 0
        for job, results in zip(self.jobs, per_job, strict=True):
            for result in results:
                completion_tokens += len(result.token_ids)
                output = EngineOutput(
                    new_token_ids=result.token_ids,
                    logprobs=result.logprobs,
                    finish_reason=result.finish_reason,
                    stop_reason=result.stop_reason,
                )
                step = self._step(self._decoder(job), output, final=True)
                choices.append(self._choice_json(len(choices), step, whole=True))
        return completion_json(
            response_id=self.id,
            kind=self.kind,
            created=self.created,
            model=self.pipeline.config.served_name,
            choices=choices,
            prompt_tokens=self._prompt_tokens(),
            completion_tokens=completion_tokens,
            cached_tokens=self._cached_tokens(),
        )

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """One chunk per choice delta, an optional usage chunk; the jobs end with the stream."""
        header = {
            "id": self.id,
            "object": f"{self.kind}.chunk" if self.is_chat else self.kind,
            "created": self.created,
            "model": self.pipeline.config.served_name,
        }
        decoders: dict[int, ChoiceDecoder] = {}
        completion_tokens = 0
        try:
            async for job_index, delta in merge([job.deltas() for job in self.jobs]):
                index = job_index * self.n + delta.index
                decoder = decoders.get(index)
                if decoder is None:
                    decoder = decoders[index] = self._decoder(self.jobs[job_index])
                completion_tokens += len(delta.output.new_token_ids)
                step = self._step(decoder, delta.output, final=False)
                yield {**header, "choices": [self._choice_json(index, step, whole=False)]}
        finally:
            self.pipeline.jobs.remove(*self.jobs)
        options = self.stream_options
        if options is not None and options.include_usage:
            usage = usage_json(self._prompt_tokens(), completion_tokens, self._cached_tokens())
            yield {**header, "choices": [], "usage": usage}

    def _choice_json(self, index: int, step: ChoiceStep, *, whole: bool) -> dict[str, Any]:
        if self.is_chat and whole:
            return {
                "index": index,
                "message": message_json(step),
                "logprobs": logprobs_fragment(step),
                "finish_reason": step.finish_reason,
            }
        if self.is_chat:
            return chat_chunk_choice(index, step)
        return {
            "index": index,
            "text": step.text,
            "logprobs": step.logprobs,
            "finish_reason": step.finish_reason,
        }

    def _prompt_tokens(self) -> int:
        return sum(len(job.prompt_ids) for job in self.jobs)

    def _cached_tokens(self) -> int:
        return sum(job.num_cached_tokens for job in self.jobs)


async def start_chat_completion(pipeline: Pipeline, body: ChatCompletionRequest) -> CompletionRun:
    runtime = pipeline.ready(body.model)
    prompt = await chat_prompt(pipeline, runtime, body)
    prompt_ids = prompt.rendered.token_ids
    parsing = await chat_parsing(pipeline, runtime, body, prompt_ids)
    media = prompt.rendered.media
    job = start_job(
        pipeline,
        runtime,
        prompt.request_id,
        prompt_ids,
        prompt.sampling,
        media.engine_input() if media is not None else None,
    )
    return CompletionRun(
        pipeline,
        runtime,
        [job],
        kind="chat.completion",
        options=DecodeOptions.of(body),
        parsing=parsing,
        num_logprobs=body.num_logprobs,
        stream_options=body.stream_options,
    )


async def start_completion(pipeline: Pipeline, body: CompletionRequest) -> CompletionRun:
    runtime = pipeline.ready(body.model)
    prompts = await completion_prompts(pipeline, runtime, body)
    jobs: list[GenerationJob] = []
    try:
        for prompt in prompts:
            jobs.append(
                start_job(pipeline, runtime, prompt.request_id, prompt.token_ids, prompt.sampling)
            )
    except Exception:
        pipeline.jobs.remove(*jobs)
        raise
    return CompletionRun(
        pipeline,
        runtime,
        jobs,
        kind="text_completion",
        options=DecodeOptions.of(body),
        parsing=PLAIN,
        num_logprobs=body.logprobs,
        stream_options=body.stream_options,
    )
