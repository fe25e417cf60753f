"""OpenAI-compatible chat completions and completions: render -> generate -> derender.

Each step is the function the token-level endpoints use (``render``, ``generate.start_job``,
``ChoiceDecoder``), so a chat completion and the three calls made one by one give identical
tokens and text. Each choice's decoder is the one its job made: text is decoded once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tokenwire.engine.base import TokenLogprob
from tokenwire.parsers.types import AssistantMessage, ToolCall
from tokenwire.pipeline.choice import Choice
from tokenwire.pipeline.context import ModelRuntime, Pipeline
from tokenwire.pipeline.decoder import PLAIN, ChoiceDecoder, ChoiceStep, Parsing
from tokenwire.pipeline.derender import logprobs_fragment, message_json
from tokenwire.pipeline.generate import start_job
from tokenwire.pipeline.jobs import GenerationJob
from tokenwire.pipeline.logprobs import (
    engine_logprob_columns,
    prompt_logprobs_json,
    token_id_chat_logprobs,
    token_id_completion_logprobs,
)
from tokenwire.pipeline.parsing import chat_parsing
from tokenwire.pipeline.render import (
    chat_prompt,
    completion_prompts,
    completion_request_id,
)
from tokenwire.pipeline.response_json import completion_json, usage_json
from tokenwire.pipeline.routing import routed_experts_npy, routing_start
from tokenwire.pipeline.session_store import Head
from tokenwire.pipeline.sessions import SessionKey, SessionTurn, session_prompt
from tokenwire.pipeline.stream_derender import chat_chunk_choice
from tokenwire.protocol.generate import StreamOptions
from tokenwire.protocol.openai import ChatCompletionRequest, CompletionRequest, SamplingFields
from tokenwire.text.logprob_json import completion_logprobs_from
from tokenwire.text.token_table import DecodeContext


@dataclass(frozen=True, slots=True)
class AnswerOptions:
    """What an OpenAI request asks to see beyond text (vLLM's extensions)."""

    num_logprobs: int | None  # alternatives per token; None: no logprobs
    return_token_ids: bool = False
    token_id_strings: bool = False  # logprob tokens as "token_id:N"
    prompt_logprobs: bool = False
    # Completions with ``echo``: each prompt's text, put before its choices' text.
    echoed_prompts: list[str] | None = None
    # Where each choice's routed_experts start; None: the server does not capture them.
    routed_experts_start: int | None = None

    @classmethod
    def of(cls, body: SamplingFields, num_logprobs: int | None) -> AnswerOptions:
        return cls(
            num_logprobs=num_logprobs,
            return_token_ids=body.return_token_ids,
            token_id_strings=body.return_tokens_as_token_ids,
            prompt_logprobs=body.requested_prompt_logprobs is not None,
        )


class CompletionRun:
    """The job of one OpenAI request and how to turn its choices into the response's."""

    def __init__(
        self,
        pipeline: Pipeline,
        runtime: ModelRuntime,
        job: GenerationJob,
        *,
        kind: str,
        answer: AnswerOptions,
        stream_options: StreamOptions | None,
        session: SessionTurn | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.session = session  # records the turn once it ran to its end
        self.runtime = runtime
        self.job = job
        self.kind = kind
        self.answer = answer
        self.stream_options = stream_options
        self.created = int(time.time())

    def session_headers(self) -> dict[str, str]:
        """A whole answer's headers of its session turn: recorded as which, or why not."""
        return self.session.headers() if self.session is not None else {}

    @property
    def is_chat(self) -> bool:
        return self.kind == "chat.completion"

    def _step(
        self,
        choice: Choice,
        token_ids: list[int],
        text: str | None,
        entries: list[TokenLogprob] | None,
        finish_reason: str | None,
        *,
        final: bool,
    ) -> ChoiceStep:
        decoder: ChoiceDecoder | None = choice.decoder
        assert decoder is not None and text is not None, "OpenAI jobs decode every choice"
        width = self.answer.num_logprobs
        placeholders = width is not None and self.answer.token_id_strings
        offset = decoder.state.text_offset
        step = decoder.render(
            token_ids,
            text,
            finish_reason,
            logprobs=None
            if width is None or placeholders
            else engine_logprob_columns(entries or [], width),
            completion_logprobs=not self.is_chat,
            final=final or None,
        )
        if not placeholders:
            return step
        assert width is not None
        logprobs: bytes | dict[str, Any]
        if self.is_chat:
            logprobs = token_id_chat_logprobs(entries or [], width)
        else:
            logprobs = token_id_completion_logprobs(token_ids, entries or [], width, offset)
            decoder.state.text_offset += sum(map(len, logprobs["tokens"]))
        return dataclasses.replace(step, logprobs=logprobs)

    async def response(self) -> dict[str, Any]:
        job = self.job
        try:
            choices = await job.run()
        finally:
            job.end()
        result = completion_json(
            response_id=job.request_id,
            kind=self.kind,
            created=self.created,
            model=self.pipeline.config.served_name,
            choices=[self._whole_choice_json(choice) for choice in choices],
            prompt_tokens=job.prompt_tokens,
            completion_tokens=job.completion_tokens,
            cached_tokens=job.cached_tokens,
        )
        if self.is_chat:
            result.update(self._chat_prompt_fields())
        if self.session is not None:
            await self.session.record(choices[0], result["choices"][0]["message"])
        return result

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """One chunk per choice delta, an optional usage chunk; the job ends with the stream."""
        job = self.job
        header = {
            "id": job.request_id,
            "object": f"{self.kind}.chunk" if self.is_chat else self.kind,
            "created": self.created,
            "model": self.pipeline.config.served_name,
        }
        started: set[int] = set()
        reply = _StreamedReply()
        try:
            async with contextlib.aclosing(job.deltas()) as deltas:
                async for delta in deltas:
                    choice = delta.choice
                    first = choice.index not in started
                    started.add(choice.index)
                    echo = self._echo(choice) if first else None
                    step = self._step(
                        choice,
                        delta.token_ids,
                        delta.text,
                        delta.logprobs,
                        delta.finish_reason,
                        final=False,
                    )
                    if self.is_chat:
                        reply.add(step)
                        chunk_choice = chat_chunk_choice(delta.index, step)
                        if self.answer.return_token_ids:
                            chunk_choice["token_ids"] = delta.token_ids
                    else:
                        chunk_choice = self._text_choice_json(
                            choice, step, echo, delta.token_ids, first=first
                        )
                    if delta.finish_reason is not None:
                        chunk_choice.update(self._routing_json(choice))
                    chunk = {**header, "choices": [chunk_choice]}
                    if self.is_chat and len(started) == 1 and first:
                        chunk.update(self._chat_prompt_fields())  # the stream's first chunk
                    yield chunk
        finally:
            job.end()
        if self.session is not None:
            await self.session.record(job.choices[0], reply.message())
        options = self.stream_options
        if options is not None and options.include_usage:
            usage = usage_json(job.prompt_tokens, job.completion_tokens, job.cached_tokens)
            yield {**header, "choices": [], "usage": usage}

    def _chat_prompt_fields(self) -> dict[str, Any]:
        """A chat answer's prompt fields (its first chunk's, streamed): one prompt."""
        fields: dict[str, Any] = {}
        if self.answer.return_token_ids:
            fields["prompt_token_ids"] = self.job.choices[0].prompt_ids
        if self.answer.prompt_logprobs:
            fields["prompt_logprobs"] = self._prompt_logprobs_json(self.job.choices[0])
        return fields

    def _prompt_logprobs_json(self, choice: Choice) -> list[Any] | None:
        return prompt_logprobs_json(choice.prompt_ids, self.job.prompt_logprobs(choice))

    def _whole_choice_json(self, choice: Choice) -> dict[str, Any]:
        echo = self._echo(choice)
        step = self._step(
            choice,
            choice.token_ids,
            choice.text,
            choice.logprobs,
            choice.finish_reason,
            final=True,
        )
        if self.is_chat:
            result = {
                "index": choice.index,
                "message": message_json(step),
                "logprobs": logprobs_fragment(step),
                "finish_reason": step.finish_reason,
            }
            if self.answer.return_token_ids:
                result["token_ids"] = choice.token_ids
        else:
            result = self._text_choice_json(choice, step, echo, choice.token_ids, first=True)
        result.update(self._routing_json(choice))
        return result

    def _routing_json(self, choice: Choice) -> dict[str, Any]:
        """A finished choice's ``routed_experts`` (vLLM 0.33's field on chat and completion
        choices), while the server captures them."""
        start = self.answer.routed_experts_start
        if start is None:
            return {}
        return {"routed_experts": routed_experts_npy(choice.routed_experts(start))}

    def _text_choice_json(
        self,
        choice: Choice,
        step: ChoiceStep,
        echo: Echo | None,
        token_ids: list[int],
        *,
        first: bool,
    ) -> dict[str, Any]:
        """A completion choice, or a chunk of one: its prompt fields go on its first chunk."""
        text, logprobs = step.text, step.logprobs
        if echo is not None:
            text = echo.text + text
            if isinstance(logprobs, dict) and echo.logprobs is not None:
                logprobs = {key: echo.logprobs[key] + logprobs[key] for key in logprobs}
        result: dict[str, Any] = {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": step.finish_reason,
        }
        if self.answer.return_token_ids and first:
            result["prompt_token_ids"] = choice.prompt_ids
        if self.answer.prompt_logprobs and first:
            result["prompt_logprobs"] = self._prompt_logprobs_json(choice)
        if self.answer.return_token_ids:
            result["token_ids"] = token_ids
        return result

    def _echo(self, choice: Choice) -> Echo | None:
        """The echoed prompt of a completion choice: its text and, asked for, its logprobs (the
        first token's null); the choice's own logprob offsets then start after it."""
        prompts = self.answer.echoed_prompts
        if prompts is None:
            return None
        text = prompts[choice.prompt_index]
        width = self.answer.num_logprobs
        if width is None:
            return Echo(text, None)
        entries = self.job.prompt_logprobs(choice) or [None] * len(choice.prompt_ids)
        ids = choice.prompt_ids
        if self.answer.token_id_strings:
            logprobs = token_id_completion_logprobs(ids, entries, width, 0)
        else:
            scored = [
                entry or TokenLogprob(token_id, 0.0, 1, ())
                for token_id, entry in zip(ids, entries, strict=True)
            ]
            logprobs, _ = completion_logprobs_from(
                self.runtime.decoder,
                engine_logprob_columns(scored, width),
                ids,
                context=DecodeContext(),
                final=False,
            )
            logprobs["token_logprobs"][0] = None
            logprobs["top_logprobs"][0] = None
        decoder = choice.decoder
        assert decoder is not None
        decoder.state.text_offset = sum(map(len, logprobs["tokens"]))
        return Echo(text, logprobs)


class _StreamedReply:
    """A streamed chat choice's message, gathered from its steps (what a session records)."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[ToolCall] = []

    def add(self, step: ChoiceStep) -> None:
        delta = step.message
        if delta.content is not None:
            self.content.append(delta.content)
        if delta.reasoning_content is not None:
            self.reasoning.append(delta.reasoning_content)
        self.tool_calls.extend(item.call for item in delta.tool_calls)

    def message(self) -> dict[str, Any]:
        return AssistantMessage(
            content="".join(self.content) or None,
            reasoning_content="".join(self.reasoning) or None,
            tool_calls=self.tool_calls,
        ).to_json()


@dataclass(frozen=True, slots=True)
class Echo:
    text: str
    logprobs: dict[str, Any] | None


async def start_chat_completion(
    pipeline: Pipeline,
    body: ChatCompletionRequest,
    *,
    session: SessionKey | None = None,
    dialect: str = "chat",
    continued: Head | None = None,
) -> CompletionRun:
    """The chat request's run; with a ``session`` its prompt continues that session (see
    ``pipeline.sessions``) and the run records its turn there."""
    runtime = pipeline.ready(body.model)
    turn: SessionTurn | None = None
    if session is None:
        prompt = await chat_prompt(pipeline, runtime, body)
    else:
        prompt, turn = await session_prompt(
            pipeline, runtime, body, pipeline.session_store(), session, dialect, continued
        )
    parsing: Parsing = await chat_parsing(pipeline, runtime, body, prompt.prompt.token_ids)
    start = routing_start(runtime, [len(prompt.prompt.token_ids)], body.routed_experts_prompt_start)
    job = await start_job(
        pipeline,
        runtime,
        prompt.request_id,
        [prompt.prompt],
        streamed=body.stream,
        parsing=parsing,
        adapter=pipeline.adapter_of(body.model),
    )
    return CompletionRun(
        pipeline,
        runtime,
        job,
        kind="chat.completion",
        answer=dataclasses.replace(
            AnswerOptions.of(body, body.num_logprobs), routed_experts_start=start
        ),
        stream_options=body.stream_options,
        session=turn,
    )


async def start_completion(pipeline: Pipeline, body: CompletionRequest) -> CompletionRun:
    runtime = pipeline.ready(body.model)
    prompts = await completion_prompts(pipeline, runtime, body)
    start = routing_start(
        runtime, [len(prompt.token_ids) for prompt in prompts], body.routed_experts_prompt_start
    )
    job = await start_job(
        pipeline,
        runtime,
        completion_request_id(body),
        prompts,
        streamed=body.stream,
        parsing=PLAIN,
        adapter=pipeline.adapter_of(body.model),
    )
    answer = dataclasses.replace(AnswerOptions.of(body, body.logprobs), routed_experts_start=start)
    if body.echo:
        texts = [
            text if isinstance(text, str) else runtime.tokenizer.decode(prompt.token_ids)
            for text, prompt in zip(body.prompts, prompts, strict=True)
        ]
        answer = dataclasses.replace(answer, echoed_prompts=texts)
    return CompletionRun(
        pipeline,
        runtime,
        job,
        kind="text_completion",
        answer=answer,
        stream_options=body.stream_options,
    )
