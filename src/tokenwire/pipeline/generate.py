"""/inference/v1/generate: token ids in, token ids and logprobs out; and starting any job."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from tokenwire.engine.base import Grammar, LogprobsMode, SamplingParams, SamplingSupport
from tokenwire.pipeline.choice import Choice, ChoiceDelta, ChoiceRequest, engine_request_id
from tokenwire.pipeline.context import ModelRuntime, Pipeline
from tokenwire.pipeline.core_channel import ChoiceSpec, JobSpec
from tokenwire.pipeline.decoder import PLAIN, ChoiceDecoder, ChoiceStep, DecodeOptions, Parsing
from tokenwire.pipeline.derender import message_json
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.pipeline.jobs import ChoiceRunner, GenerationJob
from tokenwire.pipeline.logprobs import (
    prompt_logprobs_json,
    prompt_token_id_logprobs_json,
    token_logprobs_json,
)
from tokenwire.pipeline.parsing import chat_parsing, reasoning_before_output
from tokenwire.pipeline.response_json import usage_json
from tokenwire.pipeline.routing import FEATURE as ROUTING_FEATURE
from tokenwire.pipeline.routing import check_routing_request, routed_experts_npy
from tokenwire.pipeline.validation import ValidPrompt, valid_prompt
from tokenwire.protocol.generate import GenerateRequest, SamplingParamsModel
from tokenwire.structured.grammar import GrammarError


async def start_job(
    pipeline: Pipeline,
    runtime: ModelRuntime,
    request_id: str,
    prompts: Sequence[ValidPrompt],
    *,
    streamed: bool,
    parsing: Parsing | None = None,
    adapter: str | None = None,
    adapter_param: str = "model",
) -> GenerationJob:
    """Admit a request of checked prompts and start its choices, registered so they can be
    aborted by id until the job ends.

    ``streamed``: whether the route answers as the choices go; else it answers once all ended,
    so a choice the pipeline need not watch on the way (no stop string to find) asks its engine
    for its end only (``Engine.generate``'s ``final_only``). ``parsing``: how the route reads
    the choices' text (None: it reads none; stop strings are still found, by a decoder made for
    them alone). ``adapter``: the LoRA adapter the request
    names (``adapter_param`` names the field), None for the base model; the job holds its
    current version until it ends. A structured-output constraint is compiled first (a 400
    when it cannot be), before the request is admitted.
    """
    grammars = [await request_grammar(pipeline, runtime, prompt, parsing) for prompt in prompts]
    control = pipeline.control
    version = None
    if pipeline.core is None:
        version = control.admit_job(adapter, adapter_param)
    choices: list[Choice] = []
    for prompt_index, (prompt, grammar) in enumerate(zip(prompts, grammars, strict=True)):
        params = prompt.sampling
        # Only a decoder reads them: a request with no text to read and no stop string has none.
        options = DecodeOptions.of(params) if parsing is not None or params.stop else None
        stop_strings = options.stop_strings if options is not None else ()
        for sample in range(params.n):
            decoder = None
            if options is not None and (parsing is not None or stop_strings):
                decoder = ChoiceDecoder.start(
                    runtime.decoder,
                    runtime.eos_token_ids,
                    options,
                    parsing or PLAIN,
                    prompt.token_ids,
                )
            request = ChoiceRequest(
                engine_request_id(request_id),
                prompt.token_ids,
                engine_sampling(
                    params,
                    sample,
                    sampling_mask=prompt.sampling_mask,
                    logprobs_mode=pipeline.config.logprobs_mode,
                    grammar=grammar,
                ),
                prompt.media,
                prompt.prompt_only,
                prompt.cache_salt,
                version,
                final_only=not streamed and not stop_strings,
            )
            choices.append(Choice(len(choices), prompt_index, sample, request, decoder))

    if pipeline.core is None:
        runner: ChoiceRunner = runtime.engine
        release = None if version is None else functools.partial(control.adapters.release, version)
    else:  # a frontend: the core admits the job and runs it
        choice_specs = [choice_spec(choice.request) for choice in choices]
        remote = await pipeline.core.open_job(
            JobSpec(request_id, adapter, adapter_param, choice_specs)
        )
        runner, release = remote, remote.close

    def ended() -> None:
        pipeline.jobs.remove(job)
        if release is not None:
            release()

    job = GenerationJob(runner, request_id, choices, on_end=ended)
    try:
        pipeline.jobs.add(job)
    except BaseException:
        if release is not None:
            release()
        raise
    return job


def choice_spec(request: ChoiceRequest) -> ChoiceSpec:
    """A choice's engine request as the job channel carries it to the core."""
    sampling = request.sampling
    grammar = sampling.grammar
    return ChoiceSpec(
        request.engine_id,
        request.prompt_ids,
        sampling if grammar is None else replace(sampling, grammar=None),
        None if grammar is None else grammar.text,
        request.media,
        request.cache_salt,
        request.final_only,
    )


async def request_grammar(
    pipeline: Pipeline, runtime: ModelRuntime, prompt: ValidPrompt, parsing: Parsing | None
) -> Grammar | None:
    """The compiled output constraint of a prompt (None: free text): its structured outputs,
    or what its tool choice forces (``parsing.forced_tools``). With a reasoning parser on, the
    constraint starts after the model's reasoning, on every route (vLLM's rule). A 400 naming
    the field when the engine cannot enforce one or the grammar engine refuses it."""
    params = prompt.sampling
    try:
        constraint = params.constraint
    except ValueError as exc:
        raise InvalidRequest(str(exc), params.constraint_source) from exc
    forced = parsing.forced_tools if parsing is not None else None
    if forced is not None:
        if constraint is not None:
            raise InvalidRequest(
                f"tool_choice and {params.constraint_source} both constrain the output: set one",
                "tool_choice",
            )
        constraint, source = forced, "tool_choice"
    elif constraint is None:
        return None
    else:
        # Read only here: a pydantic private attribute costs microseconds per request.
        source = params.constraint_source
    grammars = runtime.grammars
    if "structured_outputs" not in runtime.engine.features or grammars is None:
        raise InvalidRequest(
            f"{source}: structured outputs are not supported by this server's engine", source
        )
    if (
        pipeline.config.reasoning_parser is not None
        and constraint.kind != "grammar"
        and grammars.has_think_tokens
    ):
        reasoning = reasoning_before_output(runtime, prompt.token_ids)
        constraint = replace(constraint, reasoning=reasoning)
    try:
        return await grammars.compile(constraint)
    except GrammarError as exc:
        raise InvalidRequest(f"{source}: {exc}", source) from exc


def engine_sampling(
    params: SamplingParamsModel,
    sample: int,
    *,
    sampling_mask: bool = False,
    logprobs_mode: LogprobsMode = "raw_logprobs",
    grammar: Grammar | None = None,
) -> SamplingParams:
    """The engine's view of one choice; choice i > 0 of a seeded request uses seed + i.
    ``logprobs_mode``: the server's, for a request that names none."""
    assert params.max_tokens is not None, "validation resolves max_tokens"
    seed = params.seed if params.seed is None else params.seed + sample
    asked = params.logprobs_mode
    mode: LogprobsMode = logprobs_mode
    if asked is not None:
        mode = "processed_logprobs" if asked.startswith("processed") else "raw_logprobs"
    return SamplingParams(
        max_tokens=params.max_tokens,
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
        prompt_logprob_token_ids=_padded_rows(params.prompt_logprob_token_ids),
        prompt_logprob_start=params.prompt_logprob_start or 0,
        logprob_token_ids=tuple(params.logprob_token_ids) if params.logprob_token_ids else None,
        sampling_mask=sampling_mask,
        grammar=grammar,
    )


def _padded_rows(rows: list[list[int]] | None) -> tuple[tuple[int, ...], ...] | None:
    """Teacher-scoring rows padded to one width with -1 (scored -inf), as vLLM pads them."""
    if rows is None:
        return None
    width = max(map(len, rows))
    return tuple((*row, *[-1] * (width - len(row))) for row in rows)


class Generation:
    """One /inference/v1/generate call: answered whole or as chunks; unregistered at the end."""

    def __init__(self, pipeline: Pipeline, job: GenerationJob, body: GenerateRequest) -> None:
        self.pipeline = pipeline
        self.job = job
        self.body = body
        params = body.sampling_params
        self.num_top = params.num_logprobs or 0
        if params.logprob_token_ids:  # the sampled token, then every given id
            self.num_top = len(params.logprob_token_ids) + 1
        # vLLM's: every choice carries its routing while the engine captures it.
        self.routed = ROUTING_FEATURE in job.engine.features
        self.output_mode = body.output_mode

    @property
    def request_id(self) -> str:
        return self.job.request_id

    async def response(self) -> dict[str, Any]:
        job = self.job
        choices = await job.run()
        result = {
            "request_id": job.request_id,
            "model": self.pipeline.config.served_name,
            "created": int(time.time()),
            "usage": usage_json(job.prompt_tokens, job.completion_tokens, job.cached_tokens),
            "choices": [self._choice_json(choice) for choice in choices],
            "prompt_logprobs": self._prompt_logprobs_json(),
        }
        if self.body.sampling_params.prompt_logprob_token_ids is not None:
            scores = job.prompt_token_id_logprobs(choices[0])
            result["prompt_token_id_logprobs"] = prompt_token_id_logprobs_json(scores)
        return result

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """One chunk per choice delta, then the usage chunk when asked for."""
        job = self.job
        options = self.body.stream_options
        include_usage = options is not None and options.include_usage
        continuous = options is not None and options.continuous_usage_stats
        sent_prompt_logprobs = False
        request_id = job.request_id
        async with contextlib.aclosing(job.deltas()) as deltas:
            async for delta in deltas:
                chunk: dict[str, Any] = {
                    "request_id": request_id,
                    "choices": [self._delta_json(delta)],
                }
                if not sent_prompt_logprobs and delta.choice.prompt_logprobs is not None:
                    sent_prompt_logprobs = True
                    chunk["prompt_logprobs"] = self._prompt_logprobs_json()
                if continuous:
                    chunk["usage"] = usage_json(job.prompt_tokens, job.completion_tokens)
                yield chunk
        if include_usage:
            yield {
                "request_id": job.request_id,
                "choices": [],
                "usage": usage_json(job.prompt_tokens, job.completion_tokens, job.cached_tokens),
            }

    def _prompt_logprobs_json(self) -> list[Any] | None:
        """The prompt's logprobs, from whichever of its choices the engine scored it with."""
        first = self.job.choices[0]
        return prompt_logprobs_json(first.prompt_ids, self.job.prompt_logprobs(first))

    def _logprobs_json(self, choice: Choice, entries: Sequence[Any] | None) -> Any:
        if choice.logprobs is None:
            return None
        return token_logprobs_json(entries or [], self.num_top)

    def _delta_json(self, delta: ChoiceDelta) -> dict[str, Any]:
        choice = delta.choice
        result: dict[str, Any] = {
            "index": choice.index,
            "token_ids": delta.token_ids,
            "logprobs": self._logprobs_json(choice, delta.logprobs),
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }
        mode = self.output_mode
        if mode == "text":
            result["text"] = delta.text
        elif mode == "derender":
            step = self._render(choice, delta.token_ids, delta.text, delta.finish_reason, False)
            result["delta"] = step.message.to_json()
        if choice.sampling_masks is not None:
            result["sampling_mask"] = _masks_json(delta.sampling_masks)
        if delta.finish_reason is not None:
            result["weight_versions"] = choice.weight_versions.spans
            if self.routed:
                result["routed_experts"] = self._routed_experts(choice)
        return result

    def _choice_json(self, choice: Choice) -> dict[str, Any]:
        result: dict[str, Any] = {
            "index": choice.index,
            "token_ids": choice.token_ids,
            "logprobs": self._logprobs_json(choice, choice.logprobs),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "weight_versions": choice.weight_versions.spans,
        }
        mode = self.output_mode
        if mode == "text":
            result["text"] = choice.text
        elif mode == "derender":
            step = self._render(choice, choice.token_ids, choice.text, choice.finish_reason, True)
            result["message"] = message_json(step)
        if choice.sampling_masks is not None:
            result["sampling_mask"] = _masks_json(choice.sampling_masks)
        if self.routed:
            result["routed_experts"] = self._routed_experts(choice)
        return result

    def _routed_experts(self, choice: Choice) -> str | None:
        """vLLM's: the whole sequence's routing from ``routed_experts_prompt_start``, sent with
        the choice's final output."""
        start = self.body.sampling_params.routed_experts_prompt_start or 0
        return routed_experts_npy(choice.routed_experts(start))

    @staticmethod
    def _render(
        choice: Choice, token_ids: list[int], text: str | None, finish: str | None, final: bool
    ) -> ChoiceStep:
        """The derender view of ids the choice's decoder has cut: reasoning and tool calls."""
        assert choice.decoder is not None and text is not None, "derender mode decodes text"
        return choice.decoder.render(token_ids, text, finish, final=final or None)


def _masks_json(masks: Sequence[SamplingSupport] | None) -> list[list[int]]:
    """vLLM's ``sampling_mask``: each output token's support ids."""
    return [list(mask.token_ids) for mask in masks or ()]


async def start_generation(
    pipeline: Pipeline, body: GenerateRequest, request_id: str
) -> Generation:
    """Resolve the prompt's media, check the request and start its job."""
    runtime = pipeline.ready(body.model)
    if body.stream and body.sampling_params.prompt_logprob_token_ids is not None:
        # As vLLM: its stream chunks have no field for the scores.
        raise InvalidRequest(
            "prompt_logprob_token_ids are not available when stream=true.",
            "sampling_params.prompt_logprob_token_ids",
        )
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
    params = body.sampling_params
    check_routing_request(
        runtime,
        len(prompt_ids),
        asked=bool(params.return_routed_experts),
        start=params.routed_experts_prompt_start or 0,
        param="sampling_params.return_routed_experts",
        start_param="sampling_params.routed_experts_prompt_start",
    )
    checked = valid_prompt(
        pipeline.config,
        runtime,
        prompt_ids,
        body.sampling_params,
        param="token_ids",
        media=media,
        sampling_mask=body.return_sampling_mask,
        cache_salt=body.cache_salt,
    )
    parsing: Parsing | None = None
    if body.output_mode == "text":
        parsing = PLAIN
    elif body.output_mode == "derender":
        parsing = await chat_parsing(pipeline, runtime, body.parse_context, prompt_ids)
    job = await start_job(
        pipeline,
        runtime,
        request_id,
        [checked],
        streamed=body.stream,
        parsing=parsing,
        adapter=pipeline.adapter_of(body.model),
    )
    return Generation(pipeline, job, body)
