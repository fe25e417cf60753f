"""Sessions: the turns of a request series sharing an ``X-Session-ID``, recorded as the engine
ran them, so a trainer reads the exact ids, logprobs and weight versions of an agent's episode.

A turn whose messages are the session's last messages (ending with the reply it was given) plus
new ones gets its prompt from extend (``keep_history``): the previous prompt and sampled ids
verbatim, then what the template writes after them. A harness that rewrote its history
(compaction, truncation, edits, other tools) gets the full render, and the turn starts a new
segment whose reason says why. Recorded ids are never rewritten: each segment's ids are its last
turn's prompt + sampled ids, and every earlier turn of the segment is a prefix of them.

A session belongs to the credential that created it (``SessionKey.owner``); the store decides
where a turn that ran goes (``SessionStore.record``), and a turn it could not record is still
answered, with ``X-Session-Unrecorded`` saying why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import TypeAdapter

from tokenwire.media.refs import chat_media_refs
from tokenwire.pipeline.choice import Choice
from tokenwire.pipeline.context import ModelRuntime, Pipeline
from tokenwire.pipeline.dialect import arguments_object
from tokenwire.pipeline.errors import InvalidRequest, UnknownSession
from tokenwire.pipeline.extend import Previous, extension
from tokenwire.pipeline.prompt_memory import template_options
from tokenwire.pipeline.render import ChatPrompt, chat_prompt, chat_request_id, chat_request_prompt
from tokenwire.pipeline.routing import routed_experts_npy, routes_of_npy
from tokenwire.pipeline.session_store import Head, NewTurn, Owner, Recorded, SessionStore
from tokenwire.protocol.chat import ChatMessage
from tokenwire.protocol.openai import ChatCompletionRequest

MAX_SESSION_ID_CHARS = 256
_MESSAGES = TypeAdapter(list[ChatMessage])


def session_id_of(value: str | None) -> str | None:
    """The ``X-Session-ID`` header's session, checked; None without the header. The id is a
    path segment of ``/v1/sessions/{id}``: printable ASCII without ``/``, so every id a turn
    records can be read and deleted."""
    if value is None:
        return None
    if (
        not value
        or len(value) > MAX_SESSION_ID_CHARS
        or not value.isascii()
        or not value.isprintable()
        or "/" in value
    ):
        raise InvalidRequest(
            f"X-Session-ID must be 1 to {MAX_SESSION_ID_CHARS} printable ASCII characters "
            "without '/'",
            "X-Session-ID",
        )
    return value


@dataclass(frozen=True, slots=True)
class SessionKey:
    """A request's session: the ``X-Session-ID`` and who sends it."""

    id: str
    owner: Owner


@dataclass(slots=True)
class SessionTurn:
    """One request's turn of a session: how its prompt was built, recorded once it ran."""

    store: SessionStore
    key: SessionKey
    dialect: str
    head: Head | None
    segment: int
    reason: str | None
    messages: list[dict[str, Any]]
    context: str
    reply_id: str  # the answer's id (what a stateful form names to continue from it)
    # Why the chat template's full render of this prompt's history would differ from the
    # recorded ids (the prompt extends them anyway); None: it would not, or it is that render.
    render_differs: str | None = None
    recorded: Recorded | None = field(default=None)

    async def record(self, choice: Choice, reply: dict[str, Any]) -> None:
        """Hand the turn (the choice's prompt, ids, logprobs) to the store; ``reply`` is the
        chat message the client got (its ``reasoning`` copy left out)."""
        reply = {key: value for key, value in reply.items() if key != "reasoning"}
        data = {
            "dialect": self.dialect,
            "sampled_ids": choice.token_ids,
            "logprobs": [entry.logprob for entry in choice.logprobs or ()],
            "finish_reason": choice.finish_reason,
            "weight_versions": choice.weight_versions.spans,
            "render_differs": self.render_differs,
        }
        turn = NewTurn(
            self.head,
            self.segment,
            self.reason,
            choice.prompt_ids,
            choice.token_ids,
            data,
            [*self.messages, reply],
            self.context,
            self.reply_id,
            routes=choice.routed_experts(),
        )
        self.recorded = await self.store.record(self.key.id, self.key.owner, turn)

    def headers(self) -> dict[str, str]:
        """What a whole answer's headers say of its turn (a stream's went out before it ran)."""
        if self.recorded is None:
            return {}
        if self.recorded.turn is not None:
            return {"X-Session-Turn": str(self.recorded.turn)}
        return {"X-Session-Unrecorded": self.recorded.unrecorded or "not recorded"}


async def session_prompt(
    pipeline: Pipeline,
    runtime: ModelRuntime,
    body: ChatCompletionRequest,
    store: SessionStore,
    key: SessionKey,
    dialect: str,
    continued: Head | None = None,
) -> tuple[ChatPrompt, SessionTurn]:
    """The prompt of a session's next turn: extended from the session's head where the request
    continues it, else the full render (a new segment, with the reason). ``continued``: the
    head a stateful form named (``continued_head``); the request's messages are the new ones."""
    if body.n != 1:
        raise InvalidRequest("a session turn samples one choice: n must be 1", "n")
    head = continued or await store.head(key.id, key.owner)
    messages = [message.model_dump(exclude_unset=True) for message in body.messages]
    if continued is not None:
        messages = [*continued.messages, *messages]
        body = ChatCompletionRequest.model_validate(
            {**body.model_dump(exclude_unset=True), "messages": messages}
        )
    # What renders the ids besides the messages: a change means a new render.
    context = template_options(body).decode()
    reason = _rewritten(head, messages, context) if head is not None else None
    if chat_media_refs(body.messages) and head is not None and reason is None:
        reason = "the messages carry media, which extend does not take: rendered in full"
    prompt: ChatPrompt | None = None
    render_differs: str | None = None
    if head is not None and reason is None:
        new_turn = body.model_copy(update={"messages": body.messages[len(head.messages) :]})
        # The history as recorded (a harness may have dropped its reasoning).
        recorded = Previous(head.token_ids, _MESSAGES.validate_python(head.messages))
        extended = await extension(pipeline, runtime, new_turn, recorded, keep_history=True)
        previous = head.token_ids
        # Extend keeps the previous ids up to the reply's end-of-turn; a turn that sampled past
        # it (ignore_eos) is not a prefix of the next prompt, so it cannot share its segment.
        if extended.extended and extended.token_ids[: len(previous)] == previous:
            assert isinstance(extended.token_ids, list)  # extended from a list: a list
            # The recorded ids were checked when their turn ran.
            ids = chat_request_prompt(
                pipeline,
                runtime,
                body,
                extended.token_ids,
                param="messages",
                record=True,
                checked=extended.kept_tokens,
            )
            prompt = ChatPrompt(chat_request_id(body), None, ids)
            render_differs = extended.render_differs
        else:
            reason = extended.reason or "extend dropped some of the previous turn's ids"
    if prompt is None:
        prompt = await chat_prompt(pipeline, runtime, body, record=True)
    segment = 0 if head is None else head.segment + (reason is not None)
    turn = SessionTurn(
        store,
        key,
        dialect,
        head,
        segment,
        reason,
        messages,
        context,
        prompt.request_id,
        render_differs,
    )
    return prompt, turn


# Where no session holds a conversation (no X-Session-ID): the anthropic SDK's thread helpers
# then send the whole history without ``thread``.
NO_THREADS: dict[str, object] = {
    "error_code": "thread_unsupported_request",
    "unsupported": ["thread without an X-Session-ID header"],
}


async def continued_head(
    pipeline: Pipeline, key: SessionKey | None, param: str, reply_id: str
) -> Head:
    """The head a stateful form (``param``: Anthropic's ``thread``, Responses'
    ``previous_response_id``) continues: the session's, whose last answer must be
    ``reply_id``. Only a session's last answer is kept, so only it can be continued. Each
    refusal carries the error code of Anthropic's threads, on which its SDK sends the whole
    history instead. Without a session it refuses before reading the store (an
    ``--api-server-count`` frontend, which serves requests without one, has none)."""
    if key is None:
        raise InvalidRequest(
            f"{param} continues a recorded session: send its X-Session-ID header (tokenwire "
            "keeps answers in sessions only), or the whole history",
            param,
            NO_THREADS,
        )
    head = await pipeline.session_store().head(key.id, key.owner)
    if head is None or head.reply_id != reply_id:
        last = f"its last answer is {head.reply_id!r}" if head else "it has no turn yet"
        code = "thread_not_found" if head is None else "thread_already_continued"
        raise InvalidRequest(
            f"{param}: {reply_id!r} is not the last answer of session {key.id!r} ({last}); "
            "only a session's last answer can be continued: send the whole history",
            param,
            {"error_code": code},
        )
    return head


def _rewritten(head: Head, messages: list[dict[str, Any]], context: str) -> str | None:
    """Why this request does not continue the session's history; None when it does."""
    if context != head.context:
        return "the tools or chat template options changed"
    history = head.messages
    if len(messages) <= len(history):
        return (
            f"history rewritten: the request has {len(messages)} messages, not more than the "
            f"{len(history)} of the session's history"
        )
    for index, (sent, kept) in enumerate(zip(messages, history, strict=False)):
        if _key(sent, kept) != _key(kept, sent):
            return f"history rewritten: message {index} differs from the session's history"
    return None


def _key(message: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """What must agree for a message sent back to be the one recorded: role, text, tool calls
    (name and arguments, not ids) and the call a tool message answers; reasoning only when both
    carry it (harnesses may drop it, the recorded ids keep it)."""
    calls = [
        (call["function"]["name"], arguments_object(call["function"]["arguments"]))
        for call in message.get("tool_calls") or ()
    ]
    key = {
        "role": message["role"],
        "content": message.get("content") or "",
        "tool_calls": calls,
        "tool_call_id": message.get("tool_call_id"),
        "name": message.get("name"),
    }
    if message.get("reasoning_content") and other.get("reasoning_content"):
        key["reasoning"] = message["reasoning_content"]
    return key


async def trajectory(store: SessionStore, session_id: str, owner: Owner) -> dict[str, Any]:
    """``GET /v1/sessions/{id}``: the turns, and each segment's whole ids with its loss mask
    (1 exactly where a turn's sampled ids sit) and, where its turns recorded them, its routed
    experts (each turn's rows from its ``routed_experts_start``, joined)."""
    stored = await store.stored(session_id, owner)
    if stored is None:
        raise UnknownSession(f"session {session_id!r} does not exist", "session_id")
    turns = stored.turns
    segments: dict[int, dict[str, Any]] = {}
    turn_json = []
    routes: dict[int, list[np.ndarray] | None] = {}  # each segment's turns' rows
    previous: list[int] = []  # the last turn's prompt + sampled ids
    for index, turn in enumerate(turns):
        data = dict(turn.data)
        if "prompt_tail" in data:
            data["prompt_ids"] = [*previous, *data.pop("prompt_tail")]
        prompt, sampled = data["prompt_ids"], data["sampled_ids"]
        previous = [*prompt, *sampled]
        turn_json.append({"turn": index, "segment": turn.segment, **data})
        segment = segments.get(turn.segment)
        if segment is None:
            segment = segments[turn.segment] = {
                "segment": turn.segment,
                "reason": turn.reason,
                "turns": [],
                "token_ids": [],
                "loss_mask": [],
            }
        segment["turns"].append(index)
        mask = segment["loss_mask"]
        # The turn's prompt starts with the segment's ids so far: only its tail is new.
        mask.extend([0] * (len(prompt) - len(mask)))
        mask.extend([1] * len(sampled))
        segment["token_ids"] = previous
        routes[turn.segment] = _joined_routes(routes.get(turn.segment, []), data)
    for index, rows in routes.items():
        if rows is not None:
            segments[index]["routed_experts"] = routed_experts_npy(np.concatenate(rows))
    return {
        "id": session_id,
        "closed": stored.closed,
        "turns": turn_json,
        "segments": list(segments.values()),
    }


def _joined_routes(rows: list[np.ndarray] | None, turn: dict[str, Any]) -> list[np.ndarray] | None:
    """A segment's rows so far with ``turn``'s appended; None where a turn has none (recorded
    without capture) or its rows do not start where the segment's end."""
    if rows is None or "routed_experts" not in turn:
        return None
    if turn["routed_experts_start"] != sum(len(part) for part in rows):
        return None
    return [*rows, routes_of_npy(turn["routed_experts"])]
