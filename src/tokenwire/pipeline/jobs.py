"""Generation jobs: one client request -> ``n`` engine requests, merged back, abortable by id.

Stop strings need text, so they are found here, above the engine, by the same per-choice
decoder that later turns the ids into text: the job ends the choice at the token that completes
one (kept in the ids, as vLLM keeps it) and reports it as the choice's ``stop_reason``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from tokenwire.engine.base import (
    EngineError,
    EngineOutput,
    FinishReason,
    MultiModalInput,
    SamplingParams,
)
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.protocol.generate import SamplingParamsModel

if TYPE_CHECKING:
    from tokenwire.engine.base import Engine, TokenLogprob
    from tokenwire.pipeline.decoder import ChoiceDecoder

T = TypeVar("T")


@dataclass(slots=True)
class ChoiceResult:
    """One finished choice of a non-streaming request."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    weight_versions: list[dict[str, Any]] = field(default_factory=list)


def add_weight_span(spans: list[dict[str, Any]], output: EngineOutput, start: int) -> None:
    """Record that output tokens [start, start + n) were sampled by ``output.weight_version``:
    vLLM's ``weight_versions`` spans, one per run of a version."""
    count = len(output.new_token_ids)
    if not count:
        return
    if spans and spans[-1]["version"] == output.weight_version and spans[-1]["end"] == start:
        spans[-1]["end"] = start + count
    else:
        spans.append({"version": output.weight_version, "start": start, "end": start + count})


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice added since its previous delta."""

    index: int
    output: EngineOutput


def engine_sampling(params: SamplingParamsModel, *, max_tokens: int, choice: int) -> SamplingParams:
    """The engine's view of one choice; choice i > 0 of a seeded request uses seed + i."""
    seed = params.seed if params.seed is None else params.seed + choice
    mode = "processed_logprobs" if params.logprobs_mode.startswith("processed") else "raw_logprobs"
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else 0,
        min_p=params.min_p,
        seed=seed,
        min_tokens=params.min_tokens,
        stop_token_ids=tuple(params.stop_token_ids or ()),
        ignore_eos=params.ignore_eos,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logprobs=params.num_logprobs,
        prompt_logprobs=params.num_prompt_logprobs,
        logprobs_mode=mode,
    )


class GenerationJob:
    """A running request: n choices, each its own engine request.

    ``stop_decoder`` makes the per-choice decoder that finds stop strings (None: no stop
    strings, nothing to decode).
    """

    def __init__(
        self,
        engine: Engine,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParamsModel,
        *,
        max_tokens: int,
        media: MultiModalInput | None = None,
        stop_decoder: Callable[[], ChoiceDecoder] | None = None,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.max_tokens = max_tokens
        self.media = media
        self.stop_decoder = stop_decoder
        self.engine_ids = (
            [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        )
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        # Prompt tokens the engine served from its prefix cache (choice 0's, as vLLM counts).
        self.num_cached_tokens = 0

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Merged deltas of all choices; leaving early aborts whatever still runs."""
        streams = [
            self._choice_outputs(index, engine_id)
            for index, engine_id in enumerate(self.engine_ids)
        ]
        async for index, output in merge(streams):
            yield ChoiceDelta(index, output)

    async def collect(self) -> list[ChoiceResult]:
        results = [ChoiceResult(index=i) for i in range(len(self.engine_ids))]
        wants_logprobs = self.params.num_logprobs is not None
        for result in results:
            result.logprobs = [] if wants_logprobs else None
        async for delta in self.deltas():
            result = results[delta.index]
            output = delta.output
            add_weight_span(result.weight_versions, output, len(result.token_ids))
            result.token_ids.extend(output.new_token_ids)
            if result.logprobs is not None and output.logprobs:
                result.logprobs.extend(output.logprobs)
            if output.finish_reason is not None:
                result.finish_reason = output.finish_reason
                result.stop_reason = output.stop_reason
        return results

    async def abort(self) -> None:
        for engine_id in self.engine_ids:
            await self.engine.abort(engine_id)

    async def _choice_outputs(self, index: int, engine_id: str) -> AsyncIterator[EngineOutput]:
        """One choice's engine outputs, cut at a stop string; closing it aborts the request."""
        sampling = engine_sampling(self.params, max_tokens=self.max_tokens, choice=index)
        decoder = self.stop_decoder() if self.stop_decoder is not None else None
        stream = self.engine.generate(engine_id, self.prompt_ids, sampling, self.media)
        try:
            async with contextlib.aclosing(stream):
                async for output in stream:
                    if output.prompt_logprobs is not None and index == 0:
                        self.prompt_logprobs = output.prompt_logprobs
                    if output.num_cached_tokens and index == 0:
                        self.num_cached_tokens = output.num_cached_tokens
                    if decoder is not None and output.finish_reason != "abort":
                        output = _cut_at_stop_string(decoder, output)
                    yield output
                    if output.finish_reason is not None:
                        return
        except EngineError as exc:
            raise InvalidRequest(str(exc), "token_ids") from exc


def _cut_at_stop_string(decoder: ChoiceDecoder, output: EngineOutput) -> EngineOutput:
    """End the choice at the token that completes a stop string (kept, like vLLM's ids)."""
    for position, token_id in enumerate(output.new_token_ids):
        decoder.text([token_id], final=False)
        if decoder.stop_string is not None:
            kept = position + 1
            return EngineOutput(
                new_token_ids=output.new_token_ids[:kept],
                logprobs=output.logprobs[:kept] if output.logprobs is not None else None,
                finish_reason="stop",
                stop_reason=decoder.stop_string,
                prompt_logprobs=output.prompt_logprobs,
                num_prompt_tokens=output.num_prompt_tokens,
            )
    return output


class JobRegistry:
    """Running jobs by client request id, so ``/abort_requests`` can find them."""

    def __init__(self) -> None:
        self._jobs: dict[str, GenerationJob] = {}

    def add(self, job: GenerationJob) -> None:
        if job.request_id in self._jobs:
            raise InvalidRequest(f"request id {job.request_id!r} is already running", "request_id")
        self._jobs[job.request_id] = job

    def remove(self, *jobs: GenerationJob) -> None:
        for job in jobs:
            if self._jobs.get(job.request_id) is job:
                del self._jobs[job.request_id]

    async def abort(self, request_ids: Sequence[str]) -> list[str]:
        """Abort the running jobs among ``request_ids``; return the ids that were running."""
        aborted = []
        for request_id in request_ids:
            job = self._jobs.get(request_id)
            if job is not None:
                await job.abort()
                aborted.append(request_id)
        return aborted

    def ids(self) -> list[str]:
        return list(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with the stream's index.

    The first error of any stream ends the merge and is raised; leaving early (or an error)
    cancels every stream still running, which closes them (and aborts their engine requests).
    """
    queue: asyncio.Queue[tuple[int, T] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
