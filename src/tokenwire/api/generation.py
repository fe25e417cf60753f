"""One client request -> ``n`` engine requests, merged back; shared by generate and OpenAI routes.

The job owns the fan-out, stop strings (which need text, so they live above the engine) and
the abort path: cancelling a job closes its engine streams, which frees their slots.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tokenwire.api.errors import APIError, bad_request
from tokenwire.api.state import ModelRuntime
from tokenwire.api.streams import merge
from tokenwire.engine.base import EngineError, EngineOutput, FinishReason, SamplingParams
from tokenwire.protocol.generate import SamplingParamsModel
from tokenwire.text.stop_strings import StopStringMatcher


@dataclass(slots=True)
class ChoiceResult:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] | None = None
    finish_reason: FinishReason | None = None


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


def check_prompt(
    runtime: ModelRuntime, token_ids: list[int], max_tokens: int | None, *, param: str
) -> int:
    """Validate ids against the model; return the max_tokens to use (default: what fits)."""
    vocab_size = runtime.engine.vocab_size
    for index, token_id in enumerate(token_ids):
        if token_id >= vocab_size:
            raise bad_request(
                f"{param}.{index}: token id {token_id} is out of vocabulary (size {vocab_size})",
                param,
            )
    limit = runtime.max_model_len
    if len(token_ids) >= limit:
        raise bad_request(
            f"The prompt has {len(token_ids)} tokens, but this model's maximum context length is "
            f"{limit} tokens, which leaves no room for output.",
            param,
        )
    room = limit - len(token_ids)
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(token_ids) + max_tokens} tokens ({len(token_ids)} in the prompt, "
            f"{max_tokens} for the completion).",
            "max_tokens",
        )
    return max_tokens


class GenerationJob:
    """A running request: n choices, each its own engine request."""

    def __init__(
        self,
        runtime: ModelRuntime,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParamsModel,
        *,
        max_tokens: int,
        media: Any = None,
    ) -> None:
        self.runtime = runtime
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.max_tokens = max_tokens
        self.media = media
        self.engine_ids = (
            [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        )
        self.prompt_logprobs: list[Any] | None = None

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
            result.token_ids.extend(delta.output.new_token_ids)
            if result.logprobs is not None and delta.output.logprobs:
                result.logprobs.extend(delta.output.logprobs)
            if delta.output.finish_reason is not None:
                result.finish_reason = delta.output.finish_reason
        return results

    async def abort(self) -> None:
        for engine_id in self.engine_ids:
            await self.runtime.engine.abort(engine_id)

    async def _choice_outputs(self, index: int, engine_id: str) -> AsyncIterator[EngineOutput]:
        """One choice's engine outputs, cut at a stop string; closing it aborts the request."""
        sampling = engine_sampling(self.params, max_tokens=self.max_tokens, choice=index)
        stops = self.params.stop_strings
        matcher = (
            StopStringMatcher(
                self.runtime.tokenizer, stops, skip_special_tokens=self.params.skip_special_tokens
            )
            if stops
            else None
        )
        stream = self.runtime.engine.generate(engine_id, self.prompt_ids, sampling, self.media)
        try:
            async with contextlib.aclosing(stream):
                async for output in stream:
                    if output.prompt_logprobs is not None and index == 0:
                        self.prompt_logprobs = output.prompt_logprobs
                    if matcher is not None and output.finish_reason != "abort":
                        output = _cut_at_stop_string(matcher, output)
                    yield output
                    if output.finish_reason is not None:
                        return
        except EngineError as exc:
            raise APIError(400, str(exc), "token_ids") from exc


def _cut_at_stop_string(matcher: StopStringMatcher, output: EngineOutput) -> EngineOutput:
    """End the choice at the token that completes a stop string (kept, like vLLM's ids)."""
    for position, token_id in enumerate(output.new_token_ids):
        if matcher.feed(token_id):
            kept = position + 1
            return EngineOutput(
                new_token_ids=output.new_token_ids[:kept],
                logprobs=output.logprobs[:kept] if output.logprobs is not None else None,
                finish_reason="stop",
                prompt_logprobs=output.prompt_logprobs,
                num_prompt_tokens=output.num_prompt_tokens,
            )
    return output
