"""Engine logprobs -> vLLM's JSON: ``token_id:N`` placeholders, sampled token first."""

from __future__ import annotations

import math
from typing import Any

from tokenwire.engine.base import TokenLogprob

FLOOR = -9999.0  # -inf and NaN are not JSON; vLLM sends this instead


def clean(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def token_logprobs_json(entries: list[TokenLogprob], num_top: int) -> dict[str, Any]:
    """``{"content": [...]}`` with max(k, 1) top entries each, the sampled token first."""
    width = max(num_top, 1)
    content = []
    for entry in entries:
        chosen = {
            "token": f"token_id:{entry.token_id}",
            "logprob": clean(entry.logprob),
            "bytes": None,
        }
        top = [chosen]
        for token_id, logprob in entry.top:
            if len(top) >= width:
                break
            if token_id != entry.token_id:
                top.append(
                    {"token": f"token_id:{token_id}", "logprob": clean(logprob), "bytes": None}
                )
        content.append({**chosen, "top_logprobs": top})
    return {"content": content}


def prompt_logprobs_json(
    prompt_ids: list[int], entries: list[TokenLogprob | None] | None
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
                "logprob": clean(entry.logprob),
                "rank": entry.rank,
                "decoded_token": None,
            }
        }
        for rank, (top_id, logprob) in enumerate(entry.top, start=1):
            position.setdefault(
                str(top_id), {"logprob": clean(logprob), "rank": rank, "decoded_token": None}
            )
        result.append(position)
    return result
