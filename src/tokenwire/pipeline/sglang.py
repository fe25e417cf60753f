"""SGLang's ``/generate``: a prompt (text or ids) in, text, ids and ``meta_info`` out.

The same job and per-choice decoder as every other path; only the JSON is SGLang's. Streaming
chunks are cumulative (``text``, ``output_ids`` and logprobs so far), SGLang's default.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from tokenwire.engine.base import EngineOutput, TokenLogprob
from tokenwire.pipeline.context import Pipeline
from tokenwire.pipeline.decoder import PLAIN, ChoiceDecoder, DecodeOptions
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.pipeline.generate import start_job
from tokenwire.pipeline.jobs import GenerationJob, add_weight_span
from tokenwire.pipeline.logprobs import engine_logprob_columns
from tokenwire.pipeline.offload import run_text_work
from tokenwire.protocol.generate import SamplingParamsModel
from tokenwire.protocol.sglang import SGLangGenerateRequest
from tokenwire.text.token_text import json_logprob


class SGLangRun:
    """One ``/generate`` call: its job, its decoder, and what it has produced so far."""

    def __init__(
        self,
        pipeline: Pipeline,
        job: GenerationJob,
        decoder: ChoiceDecoder,
        body: SGLangGenerateRequest,
    ) -> None:
        self.pipeline = pipeline
        self.job = job
        self.decoder = decoder
        self.body = body
        self.text = ""
        self.output_ids: list[int] = []
        self.logprobs: list[list[Any]] = []
        self.top_logprobs: list[list[list[Any]]] = []
        self.spans: list[dict[str, Any]] = []
        self.finish_reason: dict[str, Any] | None = None

    async def response(self) -> dict[str, Any]:
        try:
            async for delta in self.job.deltas():
                self._add(delta.output)
        finally:
            self.pipeline.jobs.remove(self.job)
        return self._json()

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        try:
            async for delta in self.job.deltas():
                self._add(delta.output)
                yield self._json()
        finally:
            self.pipeline.jobs.remove(self.job)

    def _add(self, output: EngineOutput) -> None:
        add_weight_span(self.spans, output, len(self.output_ids))
        self.output_ids.extend(output.new_token_ids)
        texts: list[str] | None = None
        columns = None
        if self.body.return_logprob:
            columns = engine_logprob_columns(output.logprobs or [], 0)
        step = self.decoder.step(
            output.new_token_ids,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            logprobs=columns if self.body.return_text_in_logprobs else None,
            completion_logprobs=True,
        )
        self.text += step.text
        if isinstance(step.logprobs, dict):
            texts = step.logprobs["tokens"]
        if self.body.return_logprob:
            self._add_logprobs(output.logprobs or [], texts)
        if output.finish_reason is not None:
            self.finish_reason = _finish_reason(output, self.output_ids)

    def _add_logprobs(self, entries: list[TokenLogprob], texts: list[str] | None) -> None:
        width = self.body.top_logprobs_num
        for position, entry in enumerate(entries):
            text = texts[position] if texts is not None else None
            self.logprobs.append([json_logprob(entry.logprob), entry.token_id, text])
            if width:
                self.top_logprobs.append(
                    [[json_logprob(lp), token_id, None] for token_id, lp in entry.top[:width]]
                )

    def _json(self) -> dict[str, Any]:
        job = self.job
        meta: dict[str, Any] = {
            "id": job.request_id,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(job.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": job.num_cached_tokens,
            "weight_version": self.spans[-1]["version"] if self.spans else None,
            "weight_versions": self.spans,
        }
        if self.body.return_logprob:
            meta["output_token_logprobs"] = self.logprobs
            if self.body.top_logprobs_num:
                meta["output_top_logprobs"] = self.top_logprobs
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": meta}


def _finish_reason(output: EngineOutput, output_ids: list[int]) -> dict[str, Any]:
    """SGLang's shape: what matched (a stop token id or string; eos: its id), or the length."""
    if output.finish_reason == "stop":
        matched = output.stop_reason
        if matched is None and output_ids:
            matched = output_ids[-1]  # eos
        return {"type": "stop", "matched": matched}
    if output.finish_reason == "length":
        return {"type": "length", "length": len(output_ids)}
    return {"type": "abort", "message": "aborted"}


def _sampling(body: SGLangGenerateRequest) -> SamplingParamsModel:
    p = body.sampling_params
    try:
        return SamplingParamsModel(
            max_tokens=p.max_new_tokens,
            min_tokens=p.min_new_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            stop=p.stop,
            stop_token_ids=p.stop_token_ids,
            ignore_eos=p.ignore_eos,
            skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens,
            include_stop_str_in_output=p.no_stop_trim,
            frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty,
            repetition_penalty=p.repetition_penalty,
            seed=p.sampling_seed,
            logprobs=body.top_logprobs_num if body.return_logprob else None,
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc), "sampling_params") from exc


async def start_sglang_generate(pipeline: Pipeline, body: SGLangGenerateRequest) -> SGLangRun:
    runtime = pipeline.ready()
    if body.input_ids is not None:
        prompt_ids = list(body.input_ids)
    else:
        text = str(body.text)
        prompt_ids = await run_text_work(len(text), lambda: runtime.tokenizer.encode(text))
    params = _sampling(body)
    request_id = body.rid or uuid.uuid4().hex
    job = start_job(pipeline, runtime, request_id, prompt_ids, params)
    decoder = ChoiceDecoder.start(
        runtime.decoder, runtime.eos_token_ids, DecodeOptions.of(params), PLAIN, prompt_ids
    )
    return SGLangRun(pipeline, job, decoder, body)
