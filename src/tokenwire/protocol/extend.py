"""/v1/chat/completions/render and /v1/chat/completions/extend bodies.

Extend builds the next turn's prompt from the previous turn's ids, in one of two forms:
- in full: ``previous_token_ids`` (the previous prompt + the sampled ids) and
  ``previous_messages`` (the conversation they hold: the previous prompt's messages and the
  assistant reply, as derender returned it). The server needs the messages to find the turn
  boundary in the template's own render, to tell whether the template would rewrite that
  history, and for the full render it returns then;
- by reference: ``previous_prompt`` (the ``prompt_handle`` of an earlier render or extend answer,
  asked for with ``return_prompt_handle``), ``completion_token_ids`` (what was sampled after
  that prompt) and ``reply`` (the assistant message derender returned for them). The server holds
  the rest, so the body and the work are the new turn's.

``messages`` are the new messages only, in both forms.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from tokenwire.protocol.chat import ChatMessage
from tokenwire.protocol.openai import ChatCompletionRequest

TokenIds = list[Annotated[int, Field(ge=0)]]


class ChatRenderRequest(ChatCompletionRequest):
    # Remember the prompt under a handle (the answer's ``prompt_handle``) for extend to name.
    return_prompt_handle: bool = False


class ExtendRequest(ChatRenderRequest):
    previous_token_ids: TokenIds | None = Field(default=None, min_length=1)
    previous_messages: list[ChatMessage] | None = Field(default=None, min_length=2)
    previous_prompt: str | None = None
    completion_token_ids: TokenIds | None = None
    reply: ChatMessage | None = None
    # Append to the previous ids even where the template would render that history otherwise.
    keep_history: bool = False

    @model_validator(mode="after")
    def _one_form(self) -> ExtendRequest:
        full = (self.previous_token_ids, self.previous_messages)
        by_reference = (self.previous_prompt, self.completion_token_ids, self.reply)
        if any(value is not None for value in by_reference):
            if any(value is not None for value in full):
                raise ValueError(
                    "send the previous turn in full (previous_token_ids, previous_messages) or "
                    "by reference (previous_prompt, completion_token_ids, reply), not both"
                )
            if any(value is None for value in by_reference):
                raise ValueError(
                    "previous_prompt, completion_token_ids and reply go together: the handle of "
                    "the prompt, the ids sampled after it and the reply derender returned"
                )
            reply = self.reply
        elif any(value is None for value in full):
            raise ValueError(
                "send previous_token_ids and previous_messages (or previous_prompt, "
                "completion_token_ids and reply)"
            )
        else:
            assert self.previous_messages is not None
            reply = self.previous_messages[-1]
        if reply is not None and reply.role != "assistant":
            raise ValueError(
                "the previous turn must end with the assistant reply its ids end with"
                if self.reply is None
                else "reply must be the assistant message sampled after previous_prompt"
            )
        return self
