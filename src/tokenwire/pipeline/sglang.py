"""SGLang's ``/generate``: prompts (text or ids, one or a batch) in, text, ids and ``meta_info``
out.

The same job and per-choice decoder as every other path; only the JSON is SGLang's. Streaming
chunks are cumulative (``text``, ``output_ids`` and logprobs so far), SGLang's default, or
deltas under ``--incremental-streaming-output`` (SGLang's flag). Cumulative chunks grow with
the output, so sending one per token costs O(n^2) bytes (797 MB for 1,500 tokens with top-20
logprobs): one is sent only once the output grew by 1/``COALESCE`` since the last one sent
(and always at the end), which keeps the whole stream within about ``COALESCE + 1`` times its
final chunk while the first tokens still go out one by one.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tokenwire.engine.base import TokenLogprob
from tokenwire.ids import random_hex
from tokenwire.pipeline.choice import Choice, ChoiceDelta
from tokenwire.pipeline.context import Pipeline
from tokenwire.pipeline.decoder import PLAIN
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.pipeline.generate import start_job
from tokenwire.pipeline.jobs import GenerationJob
from tokenwire.pipeline.logprobs import alternatives, engine_logprob_columns
from tokenwire.pipeline.offload import run_text_work
from tokenwire.pipeline.routing import check_routing_request, routed_experts_int32
from tokenwire.pipeline.validation import valid_prompt
from tokenwire.protocol.generate import SamplingParamsModel
from tokenwire.protocol.sglang import SGLangGenerateRequest
from tokenwire.structured.spec import constraint_of
from tokenwire.text.token_text import json_logprob

# A cumulative chunk goes out once the output grew by 1/COALESCE of what was last sent.
COALESCE = 8


@dataclass(slots=True)
class _Sent:
    """How much of a choice its previous stream chunk carried."""

    tokens: int = 0
    text: int = 0
    masks: int = 0


@dataclass(slots=True)
class _Rows:
    """One choice's SGLang logprob rows so far: ``[logprob, token_id, text]`` each."""

    output: list[list[Any]] = field(default_factory=list)
    output_top: list[list[list[Any]] | None] = field(default_factory=list)


class SGLangRun:
    """One ``/generate`` call: its job and each choice's logprob rows.

    A batch (or ``n > 1``) is answered with a list, prompt by prompt and each prompt's choices
    in order; streamed, each event is one choice's result (cumulative, or its delta) with its
    ``index``.
    """

    def __init__(
        self, pipeline: Pipeline, job: GenerationJob, body: SGLangGenerateRequest, rids: list[str]
    ) -> None:
        self.pipeline = pipeline
        self.job = job
        self.body = body
        self.rids = rids  # per prompt
        self.listed = body.batched or len(job.choices) > 1
        self.rows = {choice.index: _Rows() for choice in job.choices}

    async def response(self) -> dict[str, Any] | list[dict[str, Any]]:
        try:
            async for delta in self.job.deltas():
                self._add(delta)
        finally:
            self.job.end()
        results = [self._json(choice) for choice in self.job.choices]
        return results if self.listed else results[0]

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        incremental = self.pipeline.config.incremental_streaming_output
        sent: dict[int, _Sent] = {}  # per choice index, once it has had a chunk
        try:
            async with contextlib.aclosing(self.job.deltas()) as deltas:
                async for delta in deltas:
                    self._add(delta)
                    choice, previous = delta.choice, sent.get(delta.index)
                    tokens = len(choice.token_ids)
                    if incremental:
                        result = self._json(choice, since=previous or _Sent())
                    elif (
                        previous is None
                        or delta.finish_reason is not None
                        or (tokens - previous.tokens) * COALESCE >= previous.tokens
                    ):
                        result = self._json(choice)
                    else:
                        continue  # coalesced into a later cumulative chunk
                    sent[delta.index] = _Sent(
                        tokens, len(choice.text), len(choice.sampling_masks or ())
                    )
                    if self.listed:
                        result["index"] = delta.index
                    yield result
        finally:
            self.job.end()

    def _add(self, delta: ChoiceDelta) -> None:
        """Keep the decoder in step (logprob token texts need it) and the logprob rows."""
        decoder = delta.choice.decoder
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
        rows = self.rows[delta.index]
        for position, entry in enumerate(entries):
            text = texts[position] if texts is not None else None
            rows.output.append([json_logprob(entry.logprob), entry.token_id, text])
            rows.output_top.append(self._top_row(entry))

    def _top_row(self, entry: TokenLogprob | None) -> list[list[Any]] | None:
        if entry is None:
            return None
        width = self.body.top_logprobs_num
        return [
            [json_logprob(lp), token_id, None] for token_id, lp, _ in alternatives(entry, width)
        ]

    def _json(self, choice: Choice, since: _Sent | None = None) -> dict[str, Any]:
        """The choice's result; with ``since``, only what came after it (a delta chunk: text,
        ids and per-token lists from there on; input logprobs in the first chunk only)."""
        start = since or _Sent()
        meta: dict[str, Any] = {
            "id": self.rids[choice.prompt_index],
            "finish_reason": _finish_reason(choice),
            "prompt_tokens": len(choice.prompt_ids),
            "completion_tokens": len(choice.token_ids),
            "cached_tokens": choice.num_cached_tokens,
            "weight_version": choice.weight_versions.latest,
            "weight_versions": choice.weight_versions.spans,
        }
        body = self.body
        if body.return_logprob:
            rows = self.rows[choice.index]
            meta["output_token_logprobs"] = rows.output[start.tokens :]
            if body.top_logprobs_num:
                meta["output_top_logprobs"] = rows.output_top[start.tokens :]
            if body.logprob_start_len >= 0 and not start.tokens:
                meta.update(self._input_logprobs(choice))
        if choice.sampling_masks is not None:
            masks = choice.sampling_masks[start.masks :]
            meta["output_token_sampling_mask"] = [list(mask.token_ids) for mask in masks]
            meta["output_token_sampling_logprobs"] = [json_logprob(m.logprob) for m in masks]
            meta["output_token_sampling_mask_length"] = len(masks)
        if body.return_routed_experts and choice.finished:
            rows = choice.routed_experts(body.routed_experts_start_len)
            meta["routed_experts"] = routed_experts_int32(rows)
            meta["routed_experts_start_len"] = body.routed_experts_start_len
        return {
            "text": choice.text[start.text :],
            "output_ids": choice.token_ids[start.tokens :],
            "meta_info": meta,
        }

    def _input_logprobs(self, choice: Choice) -> dict[str, Any]:
        """SGLang's ``input_token_logprobs`` (and top rows) from ``logprob_start_len`` on; the
        prompt's first token has no logprob (null)."""
        start = self.body.logprob_start_len
        entries = choice.prompt_logprobs or []
        ids = choice.prompt_ids[start:]
        scored = entries[start:] if entries else [None] * len(ids)
        result: dict[str, Any] = {
            "input_token_logprobs": [
                [None if entry is None else json_logprob(entry.logprob), token_id, None]
                for token_id, entry in zip(ids, scored, strict=True)
            ]
        }
        if self.body.top_logprobs_num:
            result["input_top_logprobs"] = [self._top_row(entry) for entry in scored]
        return result


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
        structured, source = p.structured_outputs()
        if structured is not None:
            constraint_of(structured, source)  # refused here: the error names the field
        return SamplingParamsModel(
            structured_outputs=structured,
            n=p.n,
            # Scoring only (0) still runs one step; the choice drops its output (``ValidPrompt``).
            max_tokens=max(p.max_new_tokens, 1) if p.max_new_tokens is not None else None,
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
            prompt_logprobs=(
                body.top_logprobs_num
                if body.return_logprob and body.logprob_start_len >= 0
                else None
            ),
        ).constrained_by(source)
    except ValueError as exc:
        raise InvalidRequest(str(exc), "sampling_params") from exc


def _adapter(body: SGLangGenerateRequest) -> str | None:
    """SGLang's ``lora_path`` names a loaded adapter (per prompt in a batch: one for all here)."""
    given = body.lora_path if isinstance(body.lora_path, list) else [body.lora_path]
    names = set(given)
    if len(names) > 1:
        raise InvalidRequest(
            "lora_path: one adapter per request here (send a batch per adapter)", "lora_path"
        )
    return names.pop() if names else None


async def start_sglang_generate(pipeline: Pipeline, body: SGLangGenerateRequest) -> SGLangRun:
    runtime = pipeline.ready()
    sampling = _sampling(body)
    scoring = body.sampling_params.max_new_tokens == 0
    if body.text is not None:
        texts = [str(text) for text in body.prompts]
        size = sum(map(len, texts))
        all_ids = await run_text_work(size, lambda: [runtime.tokenizer.encode(t) for t in texts])
    else:
        all_ids = [list(ids) for ids in body.prompts]  # type: ignore[arg-type]
    prompts = [
        valid_prompt(
            pipeline.config,
            runtime,
            ids,
            sampling,
            param="input_ids",
            prompt_only=scoring,
            sampling_mask=body.return_sampling_mask,
            cache_salt=salt,
        )
        for ids, salt in zip(all_ids, body.cache_salts, strict=True)
    ]
    for prompt in prompts:
        check_routing_request(
            runtime,
            len(prompt.token_ids),
            asked=body.return_routed_experts,
            start=body.routed_experts_start_len,
            param="return_routed_experts",
            start_param="routed_experts_start_len",
        )
    if body.logprob_start_len >= 0 and any(
        body.logprob_start_len >= len(prompt.token_ids) for prompt in prompts
    ):
        raise InvalidRequest(
            "logprob_start_len must be less than the prompt's length", "logprob_start_len"
        )
    rid = body.rid or random_hex()
    rids = rid if isinstance(rid, list) else [rid] * len(prompts)
    job = await start_job(
        pipeline,
        runtime,
        rids[0],
        prompts,
        parsing=PLAIN,
        streamed=body.stream,
        adapter=_adapter(body),
        adapter_param="lora_path",
    )
    return SGLangRun(pipeline, job, body, rids)
