"""``GET /v1/sessions/{id}/view``: a recorded session as a page, token by token.

Each segment (with the reason it started), each turn in it: the ids the prompt added (the
template's text, mask 0) and the sampled ids (mask 1), each sampled token shaded by its logprob
and titled with its id, logprob and weight version; finish reason, dialect and what a full render
of the history would have changed. Token texts come from the server's one decoder, so bytes of a
character split across tokens show as the tokens hold them. Plain HTML and CSS, no script and
nothing fetched: a trainer reads it where it reads the JSON, with the same key.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from tokenwire.text.token_text import TokenTextDecoder

_STYLE = """
body { font: 14px/1.5 system-ui, sans-serif; margin: 1.5rem; color: #222; }
h1 { font-size: 1.2rem; } h2 { font-size: 1.05rem; margin-top: 2rem; }
.segment { border-left: 4px solid #8aa; padding-left: 1rem; margin: 1rem 0; }
.turn { margin: 1rem 0; }
.meta { color: #555; font-size: 12px; }
.ids { font: 13px/1.9 ui-monospace, monospace; white-space: pre-wrap; word-break: break-all;
  background: #fafafa; border: 1px solid #ddd; padding: .5rem; }
.tok { border-radius: 2px; }
.prompt { color: #777; }
.sampled { color: #000; outline: 1px solid #6a6; }
.legend span { padding: 0 .4rem; margin-right: .5rem; }
"""


def token_texts(decoder: TokenTextDecoder, token_ids: Sequence[int]) -> list[str]:
    """Each id's text as the server decodes it (a character split across tokens: its bytes)."""
    resolution = decoder.resolve(token_ids)
    text = decoder.table.text
    return [resolution.chosen.get(i, text[token_id]) for i, token_id in enumerate(token_ids)]


def _shade(logprob: float) -> str:
    """Green for a likely token, through yellow, to red for an unlikely one."""
    probability = math.exp(max(logprob, -50.0))
    return f"hsl({round(120 * probability)}, 75%, 82%)"


def _version_at(spans: Sequence[dict[str, Any]] | None, position: int) -> str | None:
    """The weight version of sampled position ``position`` (vLLM's spans: version, start,
    end)."""
    for span in spans or ():
        if span["start"] <= position < span["end"]:
            return str(span["version"])
    return None


def _tokens(texts: Sequence[str], ids: Sequence[int], kind: str, turn: dict[str, Any]) -> str:
    logprobs = turn.get("logprobs") or []
    spans = turn.get("weight_versions")
    out = []
    for position, (text, token_id) in enumerate(zip(texts, ids, strict=True)):
        title = f"id {token_id}"
        style = ""
        if kind == "sampled":
            if position < len(logprobs):
                title += f", logprob {logprobs[position]:.4f}"
                style = f' style="background:{_shade(logprobs[position])}"'
            version = _version_at(spans, position)
            if version is not None:
                title += f", weights {version}"
        out.append(
            f'<span class="tok {kind}" title="{html.escape(title)}"{style}>'
            f"{html.escape(text)}</span>"
        )
    return "".join(out)


def view_html(trajectory: dict[str, Any], decoder: TokenTextDecoder) -> str:
    """The page of ``trajectory`` (``sessions.trajectory``'s answer)."""
    turns = trajectory["turns"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>session {html.escape(trajectory['id'])}</title><style>{_STYLE}</style></head>",
        f"<body><h1>Session <code>{html.escape(trajectory['id'])}</code></h1>",
        f'<p class="meta">{len(turns)} turns in {len(trajectory["segments"])} segments'
        + (f"; closed: {html.escape(trajectory['closed'])}" if trajectory["closed"] else "")
        + "</p>",
        '<p class="legend meta"><span class="prompt">prompt (mask 0)</span>'
        f'<span class="sampled" style="background:{_shade(0.0)}">sampled, p=1</span>'
        f'<span class="sampled" style="background:{_shade(math.log(0.5))}">p=0.5</span>'
        f'<span class="sampled" style="background:{_shade(-10.0)}">p~0</span></p>',
    ]
    shown = 0  # ids of the segment already on the page
    for segment in trajectory["segments"]:
        reason = segment["reason"] or "the session's first turn"
        parts.append(
            f'<section class="segment" id="segment-{segment["segment"]}">'
            f"<h2>Segment {segment['segment']}</h2>"
            f'<p class="meta">started: {html.escape(reason)}</p>'
        )
        shown = 0
        for index in segment["turns"]:
            turn = turns[index]
            prompt, sampled = turn["prompt_ids"], turn["sampled_ids"]
            new_prompt = prompt[shown:] if len(prompt) >= shown else prompt
            shown = len(prompt) + len(sampled)
            texts = token_texts(decoder, [*new_prompt, *sampled])
            meta = [
                f"turn {index}",
                html.escape(str(turn.get("dialect"))),
                f"finish: {html.escape(str(turn.get('finish_reason')))}",
                f"{len(new_prompt)} prompt ids, {len(sampled)} sampled",
            ]
            if turn.get("render_differs"):
                meta.append(f"a full render would differ: {html.escape(turn['render_differs'])}")
            parts.append(
                f'<div class="turn" id="turn-{index}"><p class="meta">{" · ".join(meta)}</p>'
                '<div class="ids">'
                + _tokens(texts[: len(new_prompt)], new_prompt, "prompt", turn)
                + _tokens(texts[len(new_prompt) :], sampled, "sampled", turn)
                + "</div></div>"
            )
        parts.append("</section>")
    parts.append("</body></html>")
    return "".join(parts)
