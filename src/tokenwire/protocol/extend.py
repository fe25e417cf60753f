"""/v1/chat/completions/extend body: the next turn's prompt from the previous turn's ids.

``messages`` are the new messages only; ``previous_messages`` is the conversation that
``previous_token_ids`` hold (the previous prompt's messages and the assistant reply, as derender
returned it). The server needs it to find the turn boundary in the template's own render, to
tell whether the template would rewrite that history, and for the full render it returns then.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from tokenwire.protocol.chat import ChatMessage
from tokenwire.protocol.openai import ChatCompletionRequest


class ExtendRequest(ChatCompletionRequest):
    previous_token_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    previous_messages: list[ChatMessage] = Field(min_length=2)
    # Append to the previous ids even where the template would render that history otherwise.
    keep_history: bool = False

    @model_validator(mode="after")
    def _previous_ends_with_reply(self) -> ExtendRequest:
        if self.previous_messages[-1].role != "assistant":
            raise ValueError(
                "previous_messages must end with the assistant reply that previous_token_ids "
                "end with"
            )
        return self
