"""vLLM's ``RequestOutput`` deltas as tokenwire ``EngineOutput``s.

Three things differ from what the pipeline expects, and are settled here:

- Logprobs: vLLM gives one ``{token_id: Logprob}`` dict per position, holding the chosen token
  and the top k (k or k + 1 entries); tokenwire wants the chosen token with its rank, and the
  top k sorted by rank. With ``logprob_token_ids`` the dict holds the given ids instead of the
  top k, ranked by their place in the list; tokenwire lists them in that order.
- Weight versions: vLLM stamps every engine step with its weight version but reports spans only
  on the final output. A delta may merge steps of two versions (a slow consumer), so each delta
  is split at the version boundaries the request has seen so far.
- ``stop_reason``: without a tokenizer in vLLM, eos is one of the stop ids and comes back as the
  id; ``engine.stopping`` reports it as the stop rule does (eos: None).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenwire.engine.base import EngineOutput, FinishReason, SamplingParams, TokenLogprob
from tokenwire.engine.stopping import reported_stop_reason

# (version, index of the first output token it sampled), in order.
VersionStarts = list[tuple[str, int]]


def token_logprob(token_id: int, entries: Mapping[int, Any], k: int) -> TokenLogprob:
    """One position: the chosen ``token_id`` and the top ``k`` of vLLM's dict."""
    chosen = entries[token_id]
    top = sorted(
        ((tid, lp) for tid, lp in entries.items() if lp.rank is not None and lp.rank <= k),
        key=lambda item: item[1].rank,
    )
    return TokenLogprob(
        token_id=token_id,
        logprob=float(chosen.logprob),
        rank=int(chosen.rank),
        top=tuple((int(tid), float(lp.logprob)) for tid, lp in top[:k]),
    )


def given_logprob(token_id: int, entries: Mapping[int, Any], given: Sequence[int]) -> TokenLogprob:
    """One position of a ``logprob_token_ids`` request: the given ids' logprobs, in order. The
    chosen token's rank is vLLM's: its place in ``given`` when it is one of them."""
    chosen = entries[token_id]
    return TokenLogprob(
        token_id=token_id,
        logprob=float(chosen.logprob),
        rank=int(chosen.rank),
        top=tuple((int(i), float(entries[i].logprob)) for i in given),
    )


def prompt_logprobs(
    prompt: Sequence[int], entries: Sequence[Mapping[int, Any] | None], k: int
) -> list[TokenLogprob | None]:
    """vLLM's prompt logprobs (None for the first position) as tokenwire's."""
    return [None if e is None else token_logprob(prompt[i], e, k) for i, e in enumerate(entries)]


@dataclass(slots=True)
class OutputState:
    """What one request's conversion remembers between deltas."""

    prompt: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int]
    fallback_version: str
    # vLLM stamps the base weights' versions; a LoRA request reports its adapter's instead.
    track_versions: bool = True
    num_tokens: int = 0  # output tokens converted so far
    sent_prompt_logprobs: bool = False
    starts: VersionStarts = field(default_factory=list)

    def convert(self, output: Any, live_starts: VersionStarts | None) -> list[EngineOutput]:
        """One ``RequestOutput`` delta as one EngineOutput per weight version it spans.

        ``live_starts`` are the version starts vLLM tracks for the running request (None once
        it finished: the final output carries the spans instead).
        """
        completion = output.outputs[0]
        if self.track_versions and completion.weight_versions:
            self.starts = [(span.version, span.start) for span in completion.weight_versions]
        elif self.track_versions and live_starts:
            self.starts = list(live_starts)
        tokens = list(completion.token_ids)
        k = self.sampling.logprobs
        given = self.sampling.logprob_token_ids
        logprobs = None
        if k is not None and completion.logprobs is not None:
            pairs = zip(tokens, completion.logprobs, strict=True)
            logprobs = [
                given_logprob(t, e, given) if given else token_logprob(t, e, k) for t, e in pairs
            ]
        pieces = self._split(tokens, logprobs)
        first = pieces[0]
        if not self.sent_prompt_logprobs:
            self.sent_prompt_logprobs = True
            first.num_prompt_tokens = len(self.prompt)
            first.num_cached_tokens = int(output.num_cached_tokens or 0)
            if self.sampling.prompt_logprobs is not None and output.prompt_logprobs is not None:
                first.prompt_logprobs = prompt_logprobs(
                    self.prompt, output.prompt_logprobs, self.sampling.prompt_logprobs
                )
        if completion.finish_reason is not None:
            last = pieces[-1]
            last.finish_reason = _finish_reason(completion.finish_reason)
            last.stop_reason = reported_stop_reason(
                last.finish_reason, completion.stop_reason, self.sampling, self.eos_token_ids
            )
        self.num_tokens += len(tokens)
        return pieces

    def _split(self, tokens: list[int], logprobs: list[TokenLogprob] | None) -> list[EngineOutput]:
        """Cut tokens [num_tokens, num_tokens + len) at each version start inside them."""
        begin, end = self.num_tokens, self.num_tokens + len(tokens)
        cuts = [
            (version, max(start, begin))
            for i, (version, start) in enumerate(self.starts)
            if start < end and (i + 1 == len(self.starts) or self.starts[i + 1][1] > begin)
        ] or [(self._version_at(begin), begin)]
        pieces = []
        for i, (version, start) in enumerate(cuts):
            stop = cuts[i + 1][1] if i + 1 < len(cuts) else end
            a, b = start - begin, stop - begin
            pieces.append(
                EngineOutput(
                    new_token_ids=tokens[a:b],
                    logprobs=None if logprobs is None else logprobs[a:b],
                    weight_version=version,
                )
            )
        return pieces

    def _version_at(self, index: int) -> str:
        """The version of an output with no new tokens: the latest one seen."""
        version = self.fallback_version
        for name, start in self.starts:
            if start <= index:
                version = name
        return version


def _finish_reason(reason: str) -> FinishReason:
    """vLLM's finish reasons; "error" (a failed step) is raised by the engine before this."""
    if reason not in ("stop", "length", "abort"):
        raise RuntimeError(f"vllm engine step failed (finish reason {reason!r})")
    return reason  # type: ignore[return-value]
