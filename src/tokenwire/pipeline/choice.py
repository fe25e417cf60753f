"""One choice of a generation request: the one owner of its state.

A request of p prompts with ``n`` choices each is p x n choices, each its own engine request.
A ``Choice`` is created from a validated prompt and owns everything about it: what the engine
runs (prompt, sampling with its stop criteria, media, the engine request id), the one decoder
of its text and stop strings, its output ids and logprobs, the weight versions that sampled
them, and why it finished. The engines only report tokens, logprobs, why they stopped and the
weight version; every dialect (generate, the OpenAI routes, SGLang's ``/generate``) only
formats a choice.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenwire.engine.base import (
    AdapterVersion,
    EngineOutput,
    FinishReason,
    MultiModalInput,
    SamplingParams,
    SamplingSupport,
    TokenLogprob,
)
from tokenwire.engine.stopping import StopReason
from tokenwire.pipeline.decoder import ChoiceDecoder

# Engine request ids: minted here, never parsed, unique for the life of the process whatever
# ids clients choose (a client's "x-1" must not meet choice 1 of a client's "x").
_ENGINE_IDS = itertools.count()


def engine_request_id(request_id: str) -> str:
    return f"{request_id}#{next(_ENGINE_IDS)}"


@dataclass(slots=True)
class ChoiceRequest:
    """What the engine runs for one choice; never changed once made (not frozen, whose
    ``__init__`` costs 3x as much, once per choice)."""

    engine_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    media: MultiModalInput | None = None
    prompt_only: bool = False  # the output is dropped: the prompt's logprobs are the answer
    cache_salt: str | None = None  # prefix-cache blocks are shared only under the same salt
    adapter: AdapterVersion | None = None  # the LoRA adapter version it runs under
    # The engine may hold its outputs until the end (``Engine.generate``'s ``final_only``).
    final_only: bool = False


@dataclass(slots=True)
class WeightSpans:
    """vLLM's ``weight_versions``: output tokens [start, end) sampled by one version, in order."""

    spans: list[dict[str, Any]] = field(default_factory=list)

    def add(self, version: str, start: int, count: int) -> None:
        spans = self.spans
        if spans:  # most outputs extend the last span (once per streamed token)
            last = spans[-1]
            if last["end"] == start and last["version"] == version:
                last["end"] = start + count
                return
        if count:
            spans.append({"version": version, "start": start, "end": start + count})

    @property
    def latest(self) -> str | None:
        return self.spans[-1]["version"] if self.spans else None


@dataclass(slots=True)
class ChoiceDelta:
    """What one engine output added to a choice, cut at a stop string. One is made per engine
    output (per token when streaming): not frozen, whose ``__init__`` costs 5x as much."""

    choice: Choice
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    sampling_masks: list[SamplingSupport] | None
    # The visible text these ids add; None when nobody reads this choice's text.
    text: str | None
    finish_reason: FinishReason | None
    stop_reason: StopReason

    @property
    def index(self) -> int:
        return self.choice.index


class Choice:
    """One choice: its engine request, its decoder and everything it produced."""

    def __init__(
        self,
        index: int,
        prompt_index: int,
        sample: int,
        request: ChoiceRequest,
        decoder: ChoiceDecoder | None,
    ) -> None:
        self.index = index  # in the response, over all prompts
        self.prompt_index = prompt_index
        self.sample = sample  # which of its prompt's n choices
        self.request = request
        # Decodes text and finds stop strings; None when the request reads no text.
        self.decoder = decoder
        self.token_ids: list[int] = []
        wants_logprobs = request.sampling.logprobs is not None
        self.logprobs: list[TokenLogprob] | None = [] if wants_logprobs else None
        self.text_pieces: list[str] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: StopReason = None
        self.sampling_masks: list[SamplingSupport] | None = (
            [] if request.sampling.sampling_mask else None
        )
        self.weight_versions = WeightSpans()
        # Reported with the engine's first output.
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.prompt_token_id_logprobs: np.ndarray | None = None
        self.num_cached_tokens = 0
        # The engine's routed-experts rows as they came (with routing capture on).
        self._routes: list[np.ndarray] = []

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self.text_pieces)

    @property
    def matched_stop(self) -> int | str | None:
        """What ended a stopped choice: the stop string or stop token id; eos: its id."""
        if self.finish_reason != "stop":
            return None
        if self.stop_reason is None and self.token_ids:
            return self.token_ids[-1]  # eos, reported as None by the stop rule
        return self.stop_reason

    def routed_experts(self, start: int = 0) -> np.ndarray | None:
        """Routing rows of positions ``start`` .. the last kept token (never fed, so it has
        none): tokens a stop string cut off take their rows with them. None: none captured
        (capture off, or aborted before any forward)."""
        if not self._routes:
            return None
        if len(self._routes) > 1:
            self._routes = [np.concatenate(self._routes)]
        end = len(self.prompt_ids) + len(self.token_ids) - 1
        return self._routes[0][start:end]

    def add(self, output: EngineOutput) -> ChoiceDelta:
        """Take the engine's next output; the choice ends at a stop string its text completes."""
        if output.routed_experts is not None:
            self._routes.append(output.routed_experts)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.prompt_token_id_logprobs is not None:
            self.prompt_token_id_logprobs = output.prompt_token_id_logprobs
        if output.num_cached_tokens:
            self.num_cached_tokens = output.num_cached_tokens
        ids = output.new_token_ids
        logprobs = output.logprobs
        masks = output.sampling_masks
        finish, stop_reason = output.finish_reason, output.stop_reason
        if self.request.prompt_only:
            ids, logprobs, masks = [], None, None
            if finish is not None and finish != "abort":
                finish, stop_reason = "length", None
        text: str | None = None
        if self.decoder is not None:
            had_stop = self.decoder.stop_string is not None
            kept, text = self.decoder.cut(ids, finish, stop_reason)
            if not had_stop and self.decoder.stop_string is not None:
                ids, finish, stop_reason = ids[:kept], "stop", self.decoder.stop_string
                logprobs = logprobs[:kept] if logprobs is not None else None
                masks = masks[:kept] if masks is not None else None
            self.text_pieces.append(text)
        self.weight_versions.add(output.weight_version, len(self.token_ids), len(ids))
        self.token_ids.extend(ids)
        if self.logprobs is not None and logprobs:
            self.logprobs.extend(logprobs)
        if self.sampling_masks is not None and masks:
            self.sampling_masks.extend(masks)
        if finish is not None:
            self.finish_reason, self.stop_reason = finish, stop_reason
        return ChoiceDelta(self, ids, logprobs, masks, text, finish, stop_reason)
