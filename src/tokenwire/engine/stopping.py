"""The stop rule: which sampled token ends a choice, and what ``stop_reason`` says about it.

One place for it (vLLM keeps it in ``check_stop``): the hf engine stops rows with it, the vllm
engine translates vLLM's own answer with it, and the pipeline's decoder reads it to keep the stop
token out of the text. Stop strings need text, so the pipeline matches them (``ChoiceDecoder``).

- From ``min_tokens`` on, eos ends a choice (unless ``ignore_eos``), reported as ``stop_reason``
  None, as vLLM reports it; then a ``stop_token_ids`` hit, reported as the id. eos is checked
  first, so an eos id the request also lists reports None.
- Before ``min_tokens`` those ids cannot be sampled (``suppressed_ids``).
- ``max_tokens`` outputs, or a full context, end it with "length".
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from tokenwire.engine.base import FinishReason, SamplingParams

StopReason = int | str | None


def suppressed_ids(sampling: SamplingParams, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    """The ids that would end a choice: masked until ``min_tokens`` outputs exist."""
    ids = tuple(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        ids += tuple(e for e in eos_token_ids if e not in ids)
    return ids


def check_stop(
    token: int,
    num_output: int,
    sampling: SamplingParams,
    eos_token_ids: Collection[int],
    *,
    context_full: bool,
) -> tuple[FinishReason | None, int | None]:
    """Whether ``token``, the ``num_output``-th output, ends the choice, and its stop reason."""
    if num_output >= sampling.min_tokens:
        if not sampling.ignore_eos and token in eos_token_ids:
            return "stop", None
        if token in sampling.stop_token_ids:
            return "stop", token
    if num_output >= sampling.max_tokens or context_full:
        return "length", None
    return None, None


def reported_stop_reason(
    finish_reason: FinishReason,
    stop_reason: StopReason,
    sampling: SamplingParams,
    eos_token_ids: Collection[int],
) -> StopReason:
    """An engine's raw stop reason as the rule reports it: eos (the engine saw it as one more
    stop id) is None unless ``ignore_eos`` made it a plain stop id."""
    if finish_reason != "stop" or stop_reason is None:
        return None
    if isinstance(stop_reason, int) and stop_reason in eos_token_ids and not sampling.ignore_eos:
        return None
    return stop_reason


def ends_with_stop_token(
    token_ids: Sequence[int],
    finish_reason: str | None,
    stop_reason: StopReason,
    *,
    eos_token_ids: Collection[int],
    stop_token_ids: Collection[int],
) -> bool:
    """Whether the last id is the stop token that ended the choice (never part of its text).

    Engines say so in ``stop_reason`` (the id; None for eos). A client that sent no
    ``stop_reason`` gets the same answer from the request's stop token ids and eos.
    """
    if finish_reason != "stop" or not token_ids or isinstance(stop_reason, str):
        return False
    last = token_ids[-1]
    if stop_reason is not None:
        return last == stop_reason
    return last in eos_token_ids or last in stop_token_ids
