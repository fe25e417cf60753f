"""OpenAI-compatible chat completions and completions: render -> generate -> derender.

Each step is the function the token-level endpoints use (``render``, ``generate.start_job``,
``ChoiceDecoder``), so a chat completion and the three calls made one by one give identical
tokens and text. Each choice's decoder is the one its job made: text is decoded once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from tokenwire.pipeline.choice import Choice
from tokenwire.pipeline.context import Pipeline
from tokenwire.pipeline.decoder import PLAIN, ChoiceDecoder, ChoiceStep, Parsing
from tokenwire.pipeline.derender import logprobs_fragment, message_json
from tokenwire.pipeline.generate import start_job
from tokenwire.pipeline.jobs import GenerationJob
from tokenwire.pipeline.logprobs import engine_logprob_columns
from tokenwire.pipeline.parsing import chat_parsing
from tokenwire.pipeline.render import (
    chat_prompt,
    completion_prompts,
    completion_request_id,
)
from tokenwire.pipeline.response_json import completion_json, usage_json
from tokenwire.pipeline.stream_derender import chat_chunk_choice
from tokenwire.protocol.generate import StreamOptions
from tokenwire.protocol.openai import ChatCompletionRequest, CompletionRequest


class CompletionRun:
    """The job of one OpenAI request and how to turn its choices into the response's.

    ``num_logprobs``: alternatives per token, None when the request wants no logprobs.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        job: GenerationJob,
        *,
        kind: str,
        num_logprobs: int | None,
        stream_options: StreamOptions | None,
    ) -> None:
        self.pipeline = pipeline
        self.job = job
        self.kind = kind
        self.num_logprobs = num_logprobs
        self.stream_options = stream_options
        self.created = int(time.time())

    @property
    def is_chat(self) -> bool:
        return self.kind == "chat.completion"

    def _step(
        self,
        choice: Choice,
        token_ids: list[int],
        text: str | None,
        entries: list[Any] | None,
        finish_reason: str | None,
        *,
        final: bool,
    ) -> ChoiceStep:
        decoder: ChoiceDecoder | None = choice.decoder
        assert decoder is not None and text is not None, "OpenAI jobs decode every choice"
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = engine_logprob_columns(entries or [], self.num_logprobs)
        return decoder.render(
            token_ids,
            text,
            finish_reason,
            logprobs=logprobs,
            completion_logprobs=not self.is_chat,
            final=final or None,
        )

    async def response(self) -> dict[str, Any]:
        job = self.job
        try:
            choices = await job.run()
        finally:
            self.pipeline.jobs.remove(job)
        return completion_json(
            response_id=job.request_id,
            kind=self.kind,
            created=self.created,
            model=self.pipeline.config.served_name,
            choices=[self._whole_choice_json(choice) for choice in choices],
            prompt_tokens=job.prompt_tokens,
            completion_tokens=job.completion_tokens,
            cached_tokens=job.cached_tokens,
        )

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """One chunk per choice delta, an optional usage chunk; the job ends with the stream."""
        job = self.job
        header = {
            "id": job.request_id,
            "object": f"{self.kind}.chunk" if self.is_chat else self.kind,
            "created": self.created,
            "model": self.pipeline.config.served_name,
        }
        try:
            async with contextlib.aclosing(job.deltas()) as deltas:
                async for delta in deltas:
                    step = self._step(
                        delta.choice,
                        delta.token_ids,
                        delta.text,
                        delta.logprobs,
                        delta.finish_reason,
                        final=False,
                    )
                    yield {**header, "choices": [self._chunk_choice_json(delta.index, step)]}
        finally:
            self.pipeline.jobs.remove(job)
        options = self.stream_options
        if options is not None and options.include_usage:
            usage = usage_json(job.prompt_tokens, job.completion_tokens, job.cached_tokens)
            yield {**header, "choices": [], "usage": usage}

    def _whole_choice_json(self, choice: Choice) -> dict[str, Any]:
        step = self._step(
            choice,
            choice.token_ids,
            choice.text,
            choice.logprobs,
            choice.finish_reason,
            final=True,
        )
        if self.is_chat:
            return {
                "index": choice.index,
                "message": message_json(step),
                "logprobs": logprobs_fragment(step),
                "finish_reason": step.finish_reason,
            }
        return self._text_choice_json(choice.index, step)

    def _chunk_choice_json(self, index: int, step: ChoiceStep) -> dict[str, Any]:
        if self.is_chat:
            return chat_chunk_choice(index, step)
        return self._text_choice_json(index, step)

    @staticmethod
    def _text_choice_json(index: int, step: ChoiceStep) -> dict[str, Any]:
        return {
            "index": index,
            "text": step.text,
            "logprobs": step.logprobs,
            "finish_reason": step.finish_reason,
        }


async def start_chat_completion(pipeline: Pipeline, body: ChatCompletionRequest) -> CompletionRun:
    runtime = pipeline.ready(body.model)
    prompt = await chat_prompt(pipeline, runtime, body)
    parsing: Parsing = await chat_parsing(pipeline, runtime, body, prompt.prompt.token_ids)
    job = start_job(pipeline, runtime, prompt.request_id, [prompt.prompt], parsing=parsing)
    return CompletionRun(
        pipeline,
        job,
        kind="chat.completion",
        num_logprobs=body.num_logprobs,
        stream_options=body.stream_options,
    )


async def start_completion(pipeline: Pipeline, body: CompletionRequest) -> CompletionRun:
    runtime = pipeline.ready(body.model)
    prompts = await completion_prompts(pipeline, runtime, body)
    job = start_job(pipeline, runtime, completion_request_id(body), prompts, parsing=PLAIN)
    return CompletionRun(
        pipeline,
        job,
        kind="text_completion",
        num_logprobs=body.logprobs,
        stream_options=body.stream_options,
    )
