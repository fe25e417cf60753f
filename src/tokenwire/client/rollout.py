"""``Rollout``: a multi-turn episode in token ids, the way a trainer needs it.

Each turn is render (first) or extend (later) -> generate -> derender -> the caller's
``respond`` (runs the tool calls, or says what the user says next) -> the next turn. Because
extend keeps the previous ids verbatim, the last turn's ``token_ids`` hold every sampled id of
the episode where the model sampled it, and ``loss_mask`` marks exactly those ids.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenwire.client.calls import Messages, jsonable
from tokenwire.client.client import AsyncClient
from tokenwire.client.errors import BadRequestError
from tokenwire.client.types import ChatMessageOut, Prompt

NewMessages = Sequence[Mapping[str, Any]] | None
Respond = Callable[["Turn"], NewMessages | Awaitable[NewMessages]]
# Text the assistant turn is forced to start with (not sampled: loss mask 0), per turn index.
Prefill = Callable[[int], str | None]


class RolloutError(Exception):
    """The server broke the extend contract (ids it said it kept differ)."""


@dataclass(slots=True)
class Turn:
    index: int
    prompt_ids: list[int]
    prefill_ids: list[int]  # forced at the start of the reply (loss mask 0)
    sampled_ids: list[int]  # what the model sampled (loss mask 1)
    message: ChatMessageOut  # the reply, derendered from prefill_ids + sampled_ids
    finish_reason: str | None
    # Whether prompt_ids start with the previous turn's ids (None on the first turn), and why
    # the extension is not what a full render gives (or why it was not extended).
    extended: bool | None
    reason: str | None
    token_ids: list[int]  # prompt_ids + prefill_ids + sampled_ids
    loss_mask: list[int]  # 1 exactly where token_ids holds an id sampled in this or a kept turn
    logprobs: list[float]  # the sampled ids' logprobs where loss_mask is 1, else 0.0
    # The weight version that sampled each id where loss_mask is 1 (what a trainer checks its
    # staleness against), else None.
    versions: list[str | None]
    # From a server started with --enable-return-routed-experts: the experts each MoE layer
    # chose at every position of token_ids but the last (never fed), [len(token_ids) - 1,
    # layers, top_k], what a trainer forces in its forward (R3); else None.
    routing: np.ndarray | None = None

    @property
    def completion_ids(self) -> list[int]:
        return [*self.prefill_ids, *self.sampled_ids]


@dataclass(slots=True)
class RolloutResult:
    messages: list[dict[str, Any]]
    turns: list[Turn] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        """The whole episode: the last turn's ids (earlier turns are its prefixes)."""
        return self.turns[-1].token_ids

    @property
    def loss_mask(self) -> list[int]:
        return self.turns[-1].loss_mask

    @property
    def logprobs(self) -> list[float]:
        return self.turns[-1].logprobs

    @property
    def versions(self) -> list[str | None]:
        return self.turns[-1].versions

    @property
    def routing(self) -> np.ndarray | None:
        return self.turns[-1].routing

    @property
    def prefix_breaks(self) -> int:
        """Turns whose prompt does not start with the previous turn's ids."""
        return sum(turn.extended is False for turn in self.turns)


class Rollout:
    """Runs episodes against one server with fixed tools, template kwargs and sampling.

    ``request_fields`` go to render and extend (``max_tokens``, ``temperature``, ``seed``, ...);
    ``keep_history`` (default true) extends even where the template would render the history
    otherwise (``Turn.reason`` says so), which keeps every sampled id for training.
    """

    def __init__(
        self,
        client: AsyncClient,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        max_turns: int = 4,
        keep_history: bool = True,
        prefill: Prefill | None = None,
        **request_fields: Any,
    ) -> None:
        if request_fields.get("n", 1) != 1:
            raise ValueError("a rollout samples one reply per turn (n=1)")
        self.client = client
        self.max_turns = max_turns
        self.keep_history = keep_history
        self.prefill = prefill
        self.template_fields = {
            "tools": list(tools) if tools else None,
            "chat_template_kwargs": dict(chat_template_kwargs) if chat_template_kwargs else None,
        }
        self.request_fields = {**request_fields, "logprobs": True, "top_logprobs": 0}

    async def run(self, messages: Messages, respond: Respond) -> RolloutResult:
        """Play up to ``max_turns`` replies; stops early when ``respond`` returns nothing."""
        result = RolloutResult(messages=jsonable(list(messages)))
        fields = {**self.template_fields, **self.request_fields}
        # The server remembers each prompt: the next extend names it, not the whole history.
        prompt: Prompt = await self.client.render_chat(
            result.messages, return_prompt_handle=True, **fields
        )
        previous: Turn | None = None
        for index in range(self.max_turns):
            turn = await self._turn(index, prompt, previous, result.messages)
            result.turns.append(turn)
            result.messages.append(turn.message.for_history())
            new_messages = respond(turn)
            if inspect.isawaitable(new_messages):
                new_messages = await new_messages
            if not new_messages or index + 1 == self.max_turns:
                break
            new = jsonable(list(new_messages))
            prompt = await self._extend(prompt, turn, result.messages, new, fields)
            result.messages.extend(new)
            previous = turn
        return result

    async def _extend(
        self,
        prompt: Prompt,
        turn: Turn,
        conversation: list[dict[str, Any]],
        new: list[dict[str, Any]],
        fields: dict[str, Any],
    ) -> Prompt:
        """The next prompt: by reference to the remembered one, or (a server that no longer
        holds it, or remembers none) from the whole history."""
        fields = {**fields, "keep_history": self.keep_history, "return_prompt_handle": True}
        if prompt.prompt_handle is not None:
            reply_ids = [*turn.prefill_ids, *turn.sampled_ids]
            try:
                return await self.client.extend_by_reference(
                    prompt.prompt_handle, reply_ids, conversation[-1], new, **fields
                )
            except BadRequestError as exc:
                if exc.param != "previous_prompt":
                    raise
        return await self.client.extend(turn.token_ids, conversation, new, **fields)

    async def _turn(
        self, index: int, prompt: Prompt, previous: Turn | None, conversation: list[dict[str, Any]]
    ) -> Turn:
        client = self.client
        text = self.prefill(index) if self.prefill else None
        prefill_ids = (await client.tokenize(text, add_special_tokens=False)).tokens if text else []
        sampling = dict(prompt.sampling_params)
        # The forced ids are part of the reply: they count against its max_tokens.
        sampling["max_tokens"] = max(1, sampling.get("max_tokens", 1) - len(prefill_ids))
        sampling["logprobs"] = 0
        generated = await client.generate(
            [*prompt.token_ids, *prefill_ids], sampling, request_id=prompt.request_id
        )
        choice = generated.choices[0]
        reply_ids = [*prefill_ids, *choice.token_ids]
        derendered = await client.derender_chat(
            {
                "request_id": generated.request_id,
                "choices": [
                    {
                        "index": 0,
                        "token_ids": reply_ids,
                        "finish_reason": choice.finish_reason,
                        "stop_reason": choice.stop_reason,
                    }
                ],
            },
            prompt_token_ids=prompt.token_ids,
            chat_request={"messages": conversation, **self.template_fields},
        )
        extended, reason, mask, logprobs, versions = _carried(prompt, previous)
        mask += [0] * len(prefill_ids) + [1] * len(choice.token_ids)
        logprobs += [0.0] * len(prefill_ids) + choice.token_logprobs
        versions += [None] * len(prefill_ids) + choice.token_versions
        return Turn(
            index=index,
            prompt_ids=prompt.token_ids,
            prefill_ids=prefill_ids,
            sampled_ids=choice.token_ids,
            message=derendered.choices[0].message,
            finish_reason=derendered.choices[0].finish_reason,
            extended=extended,
            reason=reason,
            token_ids=[*prompt.token_ids, *reply_ids],
            loss_mask=mask,
            logprobs=logprobs,
            versions=versions,
            routing=choice.routing,
        )


def _carried(
    prompt: Prompt, previous: Turn | None
) -> tuple[bool | None, str | None, list[int], list[float], list[str | None]]:
    """The prompt's mask, logprobs and versions: the kept previous ids keep theirs, the rest
    are 0 (None)."""
    size = len(prompt.token_ids)
    extended = getattr(prompt, "extended", None) if previous is not None else None
    reason = getattr(prompt, "reason", None)
    if not extended or previous is None:
        return extended, reason, [0] * size, [0.0] * size, [None] * size
    kept = prompt.kept_tokens  # type: ignore[attr-defined]
    if prompt.token_ids[:kept] != previous.token_ids[:kept]:
        raise RolloutError(f"turn {previous.index + 1}: the extended prompt changed kept ids")
    fresh = size - kept
    mask = [*previous.loss_mask[:kept], *([0] * fresh)]
    logprobs = [*previous.logprobs[:kept], *([0.0] * fresh)]
    versions = [*previous.versions[:kept], *([None] * fresh)]
    return extended, reason, mask, logprobs, versions
