"""Extend: the next turn's prompt ids = the previous turn's ids, verbatim, + what the template
writes after the reply (the bridge, the new messages, the generation prompt).

Re-rendering a conversation does not give back the ids a model sampled (leading whitespace
merges with the template's newline, non-canonical tokenisations, U+FFFD bytes, re-spaced tool
arguments, reasoning the template drops), so a trainer would train on tokens never sampled.
Nothing here is written per model family: every call renders the conversation with and without
the new messages with the model's own template and takes the text after the reply's end-of-turn
token, checking that the template really renders the history the same way in both. When it does
not (or has no such boundary), the answer says why and is the full render instead, unless the
client asks to keep its history verbatim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenwire.media.refs import chat_media_refs
from tokenwire.parsers import prompt_ends_in_think
from tokenwire.parsers.think import THINK_CLOSE
from tokenwire.pipeline.chat_render import render_template_text
from tokenwire.pipeline.context import ModelRuntime, Pipeline
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.pipeline.offload import run_text_work
from tokenwire.pipeline.render import chat_request_id, chat_request_prompt, generate_request_json
from tokenwire.pipeline.validation import check_token_ids
from tokenwire.protocol.chat import ChatMessage
from tokenwire.protocol.extend import ExtendRequest

NO_MEDIA = (
    "/v1/chat/completions/extend takes text-only messages; render conversations with media "
    "with /v1/chat/completions/render"
)


class NotExtendable(Exception):
    """The template gives no exact turn boundary here; the message says why."""


@dataclass(frozen=True, slots=True)
class Boundary:
    """What the template writes around the reply, found in its own renders."""

    close_id: int  # the end-of-turn token after the reply
    generation_prompt_ids: list[int]  # what opened the reply (found again in previous ids)
    suffix_ids: list[int]  # after the end-of-turn token: bridge, new messages, generation prompt
    # Why appending is not what a full render gives (history rendered otherwise), or None.
    differs: str | None


@dataclass(frozen=True, slots=True)
class Renders:
    """The template's texts extend compares (rendered first: request templates render in their
    worker processes): the whole conversation, and the history before the reply, with its
    generation prompt and with the reply."""

    full: str
    before: str
    prompt: str
    replied: str


@dataclass(frozen=True, slots=True)
class Extension:
    token_ids: list[int]
    extended: bool
    reason: str | None
    kept_tokens: int  # how many of previous_token_ids lead token_ids
    # Extended with the history kept as sent: why the template's full render would differ.
    render_differs: str | None = None


async def extend_chat(pipeline: Pipeline, body: ExtendRequest) -> dict[str, Any]:
    """/v1/chat/completions/extend: a GenerateRequest for the next turn, plus whether (and how
    much of) the previous ids it starts with and why not."""
    runtime = pipeline.ready(body.model)
    if chat_media_refs([*body.previous_messages, *body.messages]):
        raise InvalidRequest(NO_MEDIA, "messages")
    check_token_ids(runtime, body.previous_token_ids, "previous_token_ids")
    result = await extension(pipeline, runtime, body)
    prompt = chat_request_prompt(
        pipeline, runtime, body, result.token_ids, param="previous_token_ids"
    )
    response = generate_request_json(pipeline, chat_request_id(body), prompt, body)
    response.update(extended=result.extended, reason=result.reason, kept_tokens=result.kept_tokens)
    return response


async def extension(pipeline: Pipeline, runtime: ModelRuntime, body: ExtendRequest) -> Extension:
    """The next prompt's ids for ``body``, whose previous ids are checked."""
    renders = await _renders(pipeline, runtime, body)
    # Its work is comparing and encoding the renders (tools included), not only the messages.
    size = len(renders.full)
    return await run_text_work(size, lambda: extend_ids(pipeline, runtime, body, renders))


def extend_ids(
    pipeline: Pipeline, runtime: ModelRuntime, body: ExtendRequest, renders: Renders
) -> Extension:
    """The next prompt's ids: extended where exact (or asked to), else the full render."""
    full = renders.full
    try:
        boundary = find_boundary(runtime, body, renders)
        if boundary.differs is None or body.keep_history:
            previous = body.previous_token_ids
            kept, closing = close_previous_turn(pipeline, runtime, previous, boundary)
            token_ids = [*previous[:kept], *closing, *boundary.suffix_ids]
            reason = None if boundary.differs is None else f"{boundary.differs} (kept as sent)"
            return Extension(token_ids, True, reason, kept, boundary.differs)
        reason = boundary.differs
    except NotExtendable as exc:
        reason = str(exc)
    token_ids = runtime.tokenizer.encode(full, add_special_tokens=body.add_special_tokens)
    return Extension(token_ids, False, f"{reason}; returned the full render", 0)


def find_boundary(runtime: ModelRuntime, body: ExtendRequest, renders: Renders) -> Boundary:
    """Where the reply ends in the renders of the previous prompt, the conversation up to the
    reply, and ``full`` (with the new messages); the text after the reply's end-of-turn token in
    ``full`` is the suffix."""
    full, before, prompt, replied = renders.full, renders.before, renders.prompt, renders.replied
    if not prompt.startswith(before) or len(prompt) == len(before):
        raise NotExtendable("the chat template writes no generation prompt after the history")
    if not replied.startswith(before):
        raise NotExtendable("the chat template renders earlier turns otherwise after a reply")
    close_text, close_id, at = _last_end_of_turn(runtime, replied, start=len(before))
    cut = at + len(close_text)
    # The reply's end-of-turn is the template's k-th; in ``full`` the k-th closes the same turn.
    full_cut = _end_of_nth(full, close_text, replied.count(close_text, 0, cut))
    differs = None
    if any(message.role == "assistant" for message in body.messages):
        differs = "the new messages include an assistant message, after the sampled reply"
    elif full[:full_cut] != replied[:cut]:
        differs = "the chat template renders the history otherwise once the new messages follow"
    tokenizer = runtime.tokenizer
    # Encoded after its end-of-turn token, as it is in the full render.
    suffix_ids = tokenizer.encode(close_text + full[full_cut:], add_special_tokens=False)
    if suffix_ids[:1] != [close_id]:
        raise NotExtendable(f"{close_text!r} is not one token before the template's suffix")
    generation_prompt = prompt[len(before) :]
    return Boundary(
        close_id=close_id,
        generation_prompt_ids=tokenizer.encode(generation_prompt, add_special_tokens=False),
        suffix_ids=suffix_ids[1:],
        differs=differs,
    )


def close_previous_turn(
    pipeline: Pipeline, runtime: ModelRuntime, previous: Sequence[int], boundary: Boundary
) -> tuple[int, list[int]]:
    """How many previous ids to keep and the ids that close the reply when generation did not.

    The reply starts after the last generation prompt; it ends at its first end-of-turn token
    (ids after it are dropped). A reply cut short (max_tokens, a stop string, abort) gets one
    appended, after ``</think>`` when it was cut inside reasoning.
    """
    opened = _rfind(previous, boundary.generation_prompt_ids)
    if opened < 0:
        raise NotExtendable(
            "previous_token_ids do not contain the generation prompt this chat template writes "
            "(were they rendered with the same template, tools and chat_template_kwargs?)"
        )
    start = opened + len(boundary.generation_prompt_ids)
    for index in range(start, len(previous)):
        if previous[index] == boundary.close_id:
            return index + 1, []
    closing = [boundary.close_id]
    if pipeline.config.reasoning_parser is not None:
        reply_text = runtime.tokenizer.decode(list(previous[opened:]))
        if prompt_ends_in_think(reply_text):
            think_close = runtime.tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
            closing = [*think_close, boundary.close_id]
    return len(previous), closing


async def _renders(pipeline: Pipeline, runtime: ModelRuntime, body: ExtendRequest) -> Renders:
    history = body.previous_messages
    return Renders(
        full=await _render(pipeline, runtime, body, [*history, *body.messages], final=True),
        before=await _render(pipeline, runtime, body, history[:-1], generation_prompt=False),
        prompt=await _render(pipeline, runtime, body, history[:-1], generation_prompt=True),
        replied=await _render(pipeline, runtime, body, history, generation_prompt=False),
    )


async def _render(
    pipeline: Pipeline,
    runtime: ModelRuntime,
    body: ExtendRequest,
    messages: list[ChatMessage],
    *,
    generation_prompt: bool = False,
    final: bool = False,
) -> str:
    """The template's text for ``messages`` with the request's tools, template and kwargs;
    ``final`` is the full conversation with the request's own generation flags."""
    flags = (
        {
            "add_generation_prompt": body.add_generation_prompt,
            "continue_final_message": body.continue_final_message,
        }
        if final
        else {"add_generation_prompt": generation_prompt, "continue_final_message": False}
    )
    options = body.model_copy(update={"messages": messages, **flags})
    return await render_template_text(pipeline, runtime, options)


def _last_end_of_turn(runtime: ModelRuntime, text: str, start: int) -> tuple[str, int, int]:
    """The last end-of-turn (eos) token text at or after ``start``: (text, id, position)."""
    best: tuple[str, int, int] | None = None
    for token_id in runtime.eos_token_ids:
        token_text = runtime.tokenizer.decode([token_id])
        at = text.rfind(token_text, start) if token_text else -1
        if at >= 0 and (best is None or at > best[2]):
            best = (token_text, token_id, at)
    if best is None:
        raise NotExtendable("the chat template writes no end-of-turn token after a reply")
    return best


def _end_of_nth(text: str, needle: str, count: int) -> int:
    at = -len(needle)
    for _ in range(count):
        at = text.find(needle, at + len(needle))
        if at < 0:
            raise NotExtendable("the full render has fewer turns than the history")
    return at + len(needle)


def _rfind(ids: Sequence[int], pattern: Sequence[int]) -> int:
    """Start of the last occurrence of ``pattern`` in ``ids``, or -1."""
    size = len(pattern)
    first = pattern[0]
    for start in range(len(ids) - size, -1, -1):
        if ids[start] == first and list(ids[start : start + size]) == list(pattern):
            return start
    return -1
