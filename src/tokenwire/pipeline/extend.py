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

import orjson

from tokenwire.media.refs import chat_media_refs
from tokenwire.parsers import prompt_ends_in_think
from tokenwire.parsers.think import THINK_CLOSE
from tokenwire.pipeline.chat_render import (
    render_template_texts_then,
    server_generation_prompt,
    server_template_text,
)
from tokenwire.pipeline.context import ModelRuntime, Pipeline
from tokenwire.pipeline.errors import InvalidRequest
from tokenwire.pipeline.prompt_memory import (
    ChainedIds,
    RememberedPrompt,
    ids_json,
    template_options,
)
from tokenwire.pipeline.render import chat_request_id, chat_request_sampling, generate_request_json
from tokenwire.pipeline.session_store import Owner
from tokenwire.pipeline.validation import check_token_ids
from tokenwire.protocol.chat import ChatMessage
from tokenwire.protocol.extend import ExtendRequest
from tokenwire.protocol.openai import ChatCompletionRequest

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
    # A list, or for a remembered prompt's next turn its ids chained (``ChainedIds``).
    token_ids: list[int] | ChainedIds
    extended: bool
    reason: str | None
    kept_tokens: int  # how many of previous_token_ids lead token_ids
    full_text: str  # the template's text of the whole conversation
    # Extended with the history kept as sent: why the template's full render would differ.
    render_differs: str | None = None


@dataclass(frozen=True, slots=True)
class Previous:
    """The turn a prompt extends: its ids (prompt + sampled) and the conversation they hold
    (ending with the reply), with what the server already knows of them."""

    token_ids: list[int] | ChainedIds
    messages: list[ChatMessage]
    # Where the sampled ids start (a remembered prompt's length); None: search for the last
    # generation prompt.
    reply_start: int | None = None
    # The template's text of messages[:-1] with its generation prompt, when remembered.
    prompt_text: str | None = None
    # The remembered prompt the ids start with, when named by reference.
    remembered: RememberedPrompt | None = None


async def extend_chat(pipeline: Pipeline, body: ExtendRequest, owner: Owner) -> dict[str, Any]:
    """/v1/chat/completions/extend: a GenerateRequest for the next turn, plus whether (and how
    much of) the previous ids it starts with and why not."""
    runtime = pipeline.ready(body.model)
    previous = _previous(pipeline, runtime, body, owner)
    if chat_media_refs([*previous.messages, *body.messages]):
        raise InvalidRequest(NO_MEDIA, "messages")
    result = await extension(pipeline, runtime, body, previous, keep_history=body.keep_history)
    param = "previous_token_ids" if body.previous_prompt is None else "completion_token_ids"
    sampling = chat_request_sampling(
        pipeline, runtime, body, result.token_ids, param=param, checked=result.kept_tokens
    )
    token_ids_json = None
    if body.return_prompt_handle or body.previous_prompt is not None:
        # Kept, the remembered prompt leads the answer: its JSON is reused, not encoded again.
        lead = previous.remembered
        if lead is None or result.kept_tokens < len(lead.token_ids):
            lead = None
        token_ids_json = ids_json(result.token_ids, lead)
        answer_ids: list[int] | orjson.Fragment = orjson.Fragment(token_ids_json.array())
    else:  # a list: only a prompt named by reference (remembered) gives chained ids
        assert isinstance(result.token_ids, list)
        answer_ids = result.token_ids
    response = generate_request_json(pipeline, chat_request_id(body), answer_ids, sampling, body)
    response.update(extended=result.extended, reason=result.reason, kept_tokens=result.kept_tokens)
    if token_ids_json is not None:
        conversation = [*previous.messages, *body.messages]
        response["prompt_handle"] = pipeline.prompt_memory.remember_render(
            body, result.token_ids, conversation, result.full_text, owner, token_ids_json
        )
    return response


def _previous(
    pipeline: Pipeline, runtime: ModelRuntime, body: ExtendRequest, owner: Owner
) -> Previous:
    """The previous turn the body sends or names; the ids it sends are checked."""
    if body.previous_prompt is None:
        assert body.previous_token_ids is not None and body.previous_messages is not None
        check_token_ids(runtime, body.previous_token_ids, "previous_token_ids")
        return Previous(body.previous_token_ids, body.previous_messages)
    assert body.completion_token_ids is not None and body.reply is not None
    remembered = pipeline.prompt_memory.recall(body.previous_prompt, owner)
    if remembered.template_options != template_options(body):
        raise InvalidRequest(
            "previous_prompt was rendered with other tools, documents, chat_template, "
            "chat_template_kwargs or add_special_tokens than this request's: send the same",
            "previous_prompt",
        )
    check_token_ids(runtime, body.completion_token_ids, "completion_token_ids")
    return Previous(
        ChainedIds.joined(remembered.token_ids, body.completion_token_ids),
        [*remembered.messages, body.reply],
        reply_start=len(remembered.token_ids),
        prompt_text=remembered.text,
        remembered=remembered,
    )


async def extension(
    pipeline: Pipeline,
    runtime: ModelRuntime,
    body: ChatCompletionRequest,
    previous: Previous,
    *,
    keep_history: bool,
) -> Extension:
    """The next prompt's ids: ``previous`` extended by ``body.messages`` (the new messages),
    rendered with ``body``'s template options.

    The template renders the whole conversation and the history with the reply; the history
    before the reply with its generation prompt is the remembered prompt's text when there is
    one, and without it, that text less the generation prompt where the template is proven to
    only append one (``server_generation_prompt``), else a render of its own. The comparisons
    and encodes run in the renders' thread hop."""
    history = previous.messages
    flags = {"add_generation_prompt": False, "continue_final_message": False}
    before_options = body.model_copy(update={"messages": history[:-1], **flags})
    renders = [
        body.model_copy(update={"messages": [*history, *body.messages]}),  # the request's flags
        body.model_copy(update={"messages": history, **flags}),
    ]
    if previous.prompt_text is None:
        prompt_flags = {**flags, "add_generation_prompt": True}
        renders.append(body.model_copy(update={"messages": history[:-1], **prompt_flags}))
    generation_prompt = server_generation_prompt(pipeline, runtime, body)
    if generation_prompt is None:
        renders.append(before_options)

    def extend(texts: list[str]) -> Extension:
        full, replied = texts[:2]
        prompt = previous.prompt_text if previous.prompt_text is not None else texts[2]
        if generation_prompt is None:
            before = texts[-1]
        elif prompt.endswith(generation_prompt):
            before = prompt[: len(prompt) - len(generation_prompt)]
        else:  # not the template's text with its generation prompt (a proven one: the server's)
            before = server_template_text(runtime, before_options)
        found = Renders(full=full, before=before, prompt=prompt, replied=replied)
        return extend_ids(pipeline, runtime, body, previous, found, keep_history)

    return await render_template_texts_then(pipeline, runtime, renders, extend)


def extend_ids(
    pipeline: Pipeline,
    runtime: ModelRuntime,
    body: ChatCompletionRequest,
    previous: Previous,
    renders: Renders,
    keep_history: bool,
) -> Extension:
    """The next prompt's ids: extended where exact (or asked to), else the full render."""
    full = renders.full
    try:
        boundary = find_boundary(runtime, body.messages, renders)
        if boundary.differs is None or keep_history:
            kept, closing = close_previous_turn(pipeline, runtime, previous, boundary)
            added = [*closing, *boundary.suffix_ids]
            ids = previous.token_ids
            token_ids: list[int] | ChainedIds
            if isinstance(ids, ChainedIds):
                token_ids = ids.prefix_then(kept, added)
            else:
                token_ids = [*ids[:kept], *added]
            reason = None if boundary.differs is None else f"{boundary.differs} (kept as sent)"
            return Extension(token_ids, True, reason, kept, full, boundary.differs)
        reason = boundary.differs
    except NotExtendable as exc:
        reason = str(exc)
    token_ids = runtime.tokenizer.encode(full, add_special_tokens=body.add_special_tokens)
    return Extension(token_ids, False, f"{reason}; returned the full render", 0, full)


def find_boundary(
    runtime: ModelRuntime, new_messages: list[ChatMessage], renders: Renders
) -> Boundary:
    """Where the reply ends in the renders of the previous prompt, the conversation up to the
    reply, and ``full`` (with the new messages); the text after the reply's end-of-turn token in
    ``full`` is the suffix."""
    full, before, prompt, replied = renders.full, renders.before, renders.prompt, renders.replied
    if not prompt.startswith(before) or len(prompt) == len(before):
        raise NotExtendable("the chat template writes no generation prompt after the history")
    if not replied.startswith(before):
        raise NotExtendable("the chat template renders earlier turns otherwise after a reply")
    start = len(before)
    close_text, close_id, at = _last_end_of_turn(runtime, replied, start=start)
    cut = at + len(close_text)
    # The reply's end-of-turn is the template's k-th; in ``full`` the k-th closes the same turn.
    # (Where ``full`` starts with the history before the reply, only the reply is searched and
    # compared: long histories are not copied.)
    same_start = full.startswith(before)
    if same_start:
        full_cut = _end_of_nth(full, close_text, replied.count(close_text, start, cut), start)
    else:
        full_cut = _end_of_nth(full, close_text, replied.count(close_text, 0, cut))
    differs = None
    if any(message.role == "assistant" for message in new_messages):
        differs = "the new messages include an assistant message, after the sampled reply"
    elif not same_start or full[start:full_cut] != replied[start:cut]:
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
    pipeline: Pipeline, runtime: ModelRuntime, previous: Previous, boundary: Boundary
) -> tuple[int, list[int]]:
    """How many previous ids to keep and the ids that close the reply when generation did not.

    The reply starts after the remembered prompt when it ends with the generation prompt, else
    after the last generation prompt in the ids; it ends at its first end-of-turn token (ids
    after it are dropped). A reply cut short (max_tokens, a stop string, abort) gets one
    appended, after ``</think>`` when it was cut inside reasoning.
    """
    ids, opening = previous.token_ids, boundary.generation_prompt_ids
    start = previous.reply_start
    if start is None or list(ids[start - len(opening) : start]) != opening:
        opened = _rfind(ids, opening)
        if opened < 0:
            raise NotExtendable(
                "previous_token_ids do not contain the generation prompt this chat template "
                "writes (were they rendered with the same template, tools and "
                "chat_template_kwargs?)"
            )
        start = opened + len(opening)
    reply = ids[start:]
    if boundary.close_id in reply:
        return start + reply.index(boundary.close_id) + 1, []
    closing = [boundary.close_id]
    if pipeline.config.reasoning_parser is not None:
        reply_text = runtime.tokenizer.decode(list(ids[start - len(opening) :]))
        if prompt_ends_in_think(reply_text):
            think_close = runtime.tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
            closing = [*think_close, boundary.close_id]
    return len(ids), closing


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


def _end_of_nth(text: str, needle: str, count: int, start: int = 0) -> int:
    """The end of the ``count``-th ``needle`` in ``text`` from ``start``."""
    at = start - len(needle)
    for _ in range(count):
        at = text.find(needle, at + len(needle))
        if at < 0:
            raise NotExtendable("the full render has fewer turns than the history")
    return at + len(needle)


def _rfind(ids: Sequence[int], pattern: Sequence[int]) -> int:
    """Start of the last occurrence of ``pattern`` in ``ids``, or -1."""
    ids = ids if isinstance(ids, list) else list(ids)  # indexed one by one below
    size = len(pattern)
    first = pattern[0]
    for start in range(len(ids) - size, -1, -1):
        if ids[start] == first and list(ids[start : start + size]) == list(pattern):
            return start
    return -1
