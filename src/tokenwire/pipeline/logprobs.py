"""Engine logprobs -> vLLM's JSON, and into the columns the token-text decoder reads.

One rule picks the alternatives of a position on every route (vLLM's): the sampled token first,
then the most likely others, ``width`` entries in all. Generate answers with ``token_id:N``
placeholders; derender and the OpenAI routes resolve them to exact token texts through
``ChoiceDecoder``.
"""

from __future__ import annotations

import base64
import io
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from tokenwire.engine.base import TokenLogprob
from tokenwire.text.token_text import LogprobInput, json_logprob


def alternatives(entry: TokenLogprob, width: int) -> list[tuple[int, float, int]]:
    """(token id, logprob, rank) of a position's alternatives: the sampled token first, then
    the most likely others, ``width`` in all (fewer when the engine reported fewer)."""
    if width <= 0:
        return []
    sampled = entry.token_id
    result = [(sampled, entry.logprob, entry.rank)]
    for rank, (token_id, logprob) in enumerate(entry.top, start=1):
        if len(result) == width:
            break
        if token_id != sampled:
            result.append((token_id, logprob, rank))
    return result


def generate_width(num_logprobs: int) -> int:
    """Generate lists max(k, 1) alternatives: ``logprobs: 0`` still shows the sampled token."""
    return max(num_logprobs, 1)


def token_logprobs_json(entries: Sequence[TokenLogprob], num_top: int) -> dict[str, Any]:
    """``{"content": [...]}`` as generate answers it; each entry carries both the ``token``
    placeholder (renderers, AReaL) and ``token_id`` (vLLM 0.32+)."""
    width = generate_width(num_top)
    content = []
    # The per-token hot loop of a generate answer (a stream's too): the sampled token's two
    # entries written out as literals (a call and a ``{**sampled}`` per token cost twice as
    # much: 16 tokens 20 -> 11 µs), the alternatives through ``alternatives`` only when more
    # are asked.
    for entry in entries:
        token_id, rank = entry.token_id, entry.rank
        token, logprob = _token_id_string(token_id), json_logprob(entry.logprob)
        top = [
            {"token": token, "token_id": token_id, "logprob": logprob, "rank": rank, "bytes": None}
        ]
        if width > 1:
            top.extend(_placeholder(*alt) for alt in alternatives(entry, width)[1:])
        content.append(
            {
                "token": token,
                "token_id": token_id,
                "logprob": logprob,
                "rank": rank,
                "bytes": None,
                "top_logprobs": top,
            }
        )
    return {"content": content}


def _placeholder(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
    return {
        "token": _token_id_string(token_id),
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


def prompt_token_id_logprobs_json(scores: np.ndarray | None) -> str | None:
    """vLLM's ``prompt_token_id_logprobs``: the float32 [rows, ids] matrix as base64 ``.npy``
    bytes (``np.load(io.BytesIO(base64.b64decode(s)))`` reads it back)."""
    if scores is None:
        return None
    with io.BytesIO() as buffer:
        np.save(buffer, scores.astype(np.float32, copy=False), allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def engine_logprob_columns(entries: Sequence[TokenLogprob], width: int) -> LogprobInput:
    """An engine's logprobs in the decoder's columns, ``width`` alternatives each."""
    rows = [alternatives(entry, width) for entry in entries]
    return LogprobInput(
        token_ids=[entry.token_id for entry in entries],
        logprobs=[entry.logprob for entry in entries],
        top_ids=[[token_id for token_id, _, _ in row] for row in rows],
        top_logprobs=[[logprob for _, logprob, _ in row] for row in rows],
    )


def _token_id_string(token_id: int) -> str:
    return f"token_id:{token_id}"


def token_id_chat_logprobs(entries: Sequence[TokenLogprob], width: int) -> bytes:
    """Chat logprobs with ``"token_id:N"`` tokens (vLLM's ``return_tokens_as_token_ids``):
    ``bytes`` are the placeholder's own, as vLLM gives them."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        token = _token_id_string(token_id)
        return {"token": token, "logprob": json_logprob(logprob), "bytes": list(token.encode())}

    content = [
        {
            **item(entry.token_id, entry.logprob),
            "top_logprobs": [item(i, lp) for i, lp, _ in alternatives(entry, width)],
        }
        for entry in entries
    ]
    return orjson.dumps({"content": content})


def token_id_completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    width: int,
    text_offset: int,
) -> dict[str, Any]:
    """The completions logprobs shape with ``"token_id:N"`` tokens; a None entry (an echoed
    prompt's first token) has null logprobs, as vLLM's echo gives it."""
    tokens = [_token_id_string(token_id) for token_id in token_ids]
    offsets = list(itertools.accumulate(map(len, tokens), initial=text_offset))[:-1]
    return {
        "tokens": tokens,
        "token_logprobs": [json_logprob(e.logprob) if e else None for e in entries],
        "top_logprobs": [
            {_token_id_string(i): json_logprob(lp) for i, lp, _ in alternatives(e, width)}
            if e
            else None
            for e in entries
        ],
        "text_offset": offsets,
    }
