"""Engine logprobs -> vLLM's JSON, and into the columns the token-text decoder reads.

Generate answers with ``token_id:N`` placeholders (the sampled token first, as vLLM does);
derender and the OpenAI routes resolve them to exact token texts through ``ChoiceDecoder``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenwire.engine.base import TokenLogprob
from tokenwire.text.token_text import LogprobInput, json_logprob


def token_logprobs_json(entries: Sequence[TokenLogprob], num_top: int) -> dict[str, Any]:
    """``{"content": [...]}`` with max(k, 1) top entries each, the sampled token first.

    Each entry carries both the ``token`` placeholder (renderers, AReaL) and ``token_id``
    (vLLM 0.32+).
    """
    width = max(num_top, 1)
    content = []
    for entry in entries:
        chosen = _placeholder(entry.token_id, entry.logprob, entry.rank)
        top = [chosen]
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            if len(top) >= width:
                break
            if token_id != entry.token_id:
                top.append(_placeholder(token_id, logprob, rank))
        content.append({**chosen, "top_logprobs": top})
    return {"content": content}


def _placeholder(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
    return {
        "token": f"token_id:{token_id}",
        "token_id": token_id,
        "logprob": json_logprob(logprob),
        "rank": rank,
        "bytes": None,
    }


def prompt_logprobs_json(
    prompt_ids: Sequence[int], entries: Sequence[TokenLogprob | None] | None
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per position ``{token_id: {logprob, rank, decoded_token}}``."""
    if entries is None:
        return None
    result: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(prompt_ids, entries, strict=False):
        if entry is None:
            result.append(None)
            continue
        position = {
            str(token_id): {
                "logprob": json_logprob(entry.logprob),
                "rank": entry.rank,
                "decoded_token": None,
            }
        }
        for rank, (top_id, logprob) in enumerate(entry.top, start=1):
            position.setdefault(
                str(top_id), {"logprob": json_logprob(logprob), "rank": rank, "decoded_token": None}
            )
        result.append(position)
    return result


def engine_logprob_columns(entries: Sequence[TokenLogprob], num_top: int) -> LogprobInput:
    """An engine's logprobs in the decoder's columns, ``num_top`` alternatives each."""
    return LogprobInput(
        token_ids=[entry.token_id for entry in entries],
        logprobs=[entry.logprob for entry in entries],
        top_ids=[[token_id for token_id, _ in entry.top[:num_top]] for entry in entries],
        top_logprobs=[[logprob for _, logprob in entry.top[:num_top]] for entry in entries],
    )
