"""SGLang's ``/generate``: a prompt (text or ids) in, text, ids and ``meta_info`` out.

The same job and per-choice decoder as every other path; only the JSON is SGLang's. Streaming
chunks are cumulative (``text``, ``output_ids`` and logprobs so far), SGLang's default.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from tokenwire.pipeline.choice import Choice, ChoiceDelta
from tokenwire.pipeline.context import Pipeline
from tokenwire.pipeline.decoder import PLAIN
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.pipeline.generate import start_job
from tokenwire.pipeline.jobs import GenerationJob
from tokenwire.pipeline.logprobs import alternatives, engine_logprob_columns
from tokenwire.pipeline.offload import run_text_work
from tokenwire.pipeline.validation import valid_prompt
from tokenwire.protocol.generate import SamplingParamsModel
from tokenwire.protocol.sglang import SGLangGenerateRequest
from tokenwire.text.token_text import json_logprob


class SGLangRun:
    """One ``/generate`` call: its job and the logprob rows made so far."""

    def __init__(self, pipeline: Pipeline, job: GenerationJob, body: SGLangGenerateRequest) -> None:
        self.pipeline = pipeline
        self.job = job
        self.choice = job.choices[0]
        self.body = body
        self.logprobs: list[list[Any]] = []
        self.top_logprobs: list[list[list[Any]]] = []

    async def response(self) -> dict[str, Any]:
        try:
            async for delta in self.job.deltas():
                self._add(delta)
        finally:
            self.pipeline.jobs.remove(self.job)
        return self._json()

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        try:
            async for delta in self.job.deltas():
                self._add(delta)
                yield self._json()
        finally:
            self.pipeline.jobs.remove(self.job)

    def _add(self, delta: ChoiceDelta) -> None:
        """Keep the decoder in step (logprob token texts need it) and the logprob rows."""
        decoder = self.choice.decoder
        assert decoder is not None and delta.text is not None, "SGLang jobs decode text"
        entries = delta.logprobs or []
        wants_texts = self.body.return_logprob and self.body.return_text_in_logprobs
        step = decoder.render(
            delta.token_ids,
            delta.text,
            delta.finish_reason,
            logprobs=engine_logprob_columns(entries, 0) if wants_texts else None,
            completion_logprobs=True,
        )
        if not self.body.return_logprob:
            return
        texts = step.logprobs["tokens"] if isinstance(step.logprobs, dict) else None
        width = self.body.top_logprobs_num
        for position, entry in enumerate(entries):
            text = texts[position] if texts is not None else None
            self.logprobs.append([json_logprob(entry.logprob), entry.token_id, text])
            if width:
                self.top_logprobs.append(
                    [
                        [json_logprob(logprob), token_id, None]
                        for token_id, logprob, _ in alternatives(entry, width)
                    ]
                )

    def _json(self) -> dict[str, Any]:
        job, choice = self.job, self.choice
        meta: dict[str, Any] = {
            "id": job.request_id,
            "finish_reason": _finish_reason(choice),
            "prompt_tokens": job.prompt_tokens,
            "completion_tokens": job.completion_tokens,
            "cached_tokens": job.cached_tokens,
            "weight_version": choice.weight_versions.latest,
            "weight_versions": choice.weight_versions.spans,
        }
        if self.body.return_logprob:
            meta["output_token_logprobs"] = self.logprobs
            if self.body.top_logprobs_num:
                meta["output_top_logprobs"] = self.top_logprobs
        return {"text": choice.text, "output_ids": choice.token_ids, "meta_info": meta}


def _finish_reason(choice: Choice) -> dict[str, Any] | None:
    """SGLang's shape: what matched (a stop token id or string; eos: its id), or the length."""
    if choice.finish_reason == "stop":
        return {"type": "stop", "matched": choice.matched_stop}
    if choice.finish_reason == "length":
        return {"type": "length", "length": len(choice.token_ids)}
    if choice.finish_reason == "abort":
        return {"type": "abort", "message": "aborted"}
    return None


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
    prompt = valid_prompt(pipeline.config, runtime, prompt_ids, _sampling(body), param="input_ids")
    request_id = body.rid or uuid.uuid4().hex
    job = start_job(pipeline, runtime, request_id, [prompt], parsing=PLAIN)
    return SGLangRun(pipeline, job, body)
