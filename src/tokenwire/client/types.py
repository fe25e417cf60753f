"""What the server answers, as typed models that keep fields they do not name.

Extra fields are kept (``extra="allow"``) so a newer server's additions reach the caller; the
named ones are what RL code reads: ids, logprobs, finish reasons, the parsed message.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from tokenwire.client.routing import decode_routed_experts


class ServerModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class ModelCard(ServerModel):
    id: str
    max_model_len: int | None = None


class Prompt(ServerModel):
    """A GenerateRequest as render returns it: send it to ``generate`` as is."""

    request_id: str
    token_ids: list[int]
    sampling_params: dict[str, Any]
    features: dict[str, Any] | None = None
    model: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    # What the server remembers this prompt as (asked with ``return_prompt_handle``): the next
    # turn's ``extend_by_reference`` names it instead of resending the history.
    prompt_handle: str | None = None


class Extension(Prompt):
    """The next turn's prompt from /v1/chat/completions/extend."""

    # Whether token_ids start with previous_token_ids[:kept_tokens].
    extended: bool
    # Why the ids are not what a full render would give (or, not extended, why not); else None.
    reason: str | None = None
    kept_tokens: int = 0


class TopLogprob(ServerModel):
    token_id: int
    logprob: float
    rank: int | None = None
    token: str | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class Logprobs(ServerModel):
    content: list[TokenLogprob] | None = None


class WeightVersionSpan(ServerModel):
    """Output tokens ``start`` to ``end`` (exclusive) were sampled by weights ``version``."""

    version: str
    start: int
    end: int


class GenerateChoice(ServerModel):
    index: int = 0
    token_ids: list[int] = Field(default_factory=list)
    logprobs: Logprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Final output only (a server without --enable-rl-control may send none).
    weight_versions: list[WeightVersionSpan] | None = None
    # Final output only, from a server started with --enable-return-routed-experts.
    routed_experts: str | None = None

    @property
    def routing(self) -> np.ndarray | None:
        """``routed_experts`` decoded: ``[rows, layers, top_k]`` (``client.routing``)."""
        return None if self.routed_experts is None else decode_routed_experts(self.routed_experts)

    @property
    def token_versions(self) -> list[str | None]:
        """The weight version that sampled each output id (None where the server said none)."""
        versions: list[str | None] = [None] * len(self.token_ids)
        for span in self.weight_versions or ():
            versions[span.start : span.end] = [span.version] * (span.end - span.start)
        return versions

    @property
    def token_logprobs(self) -> list[float]:
        """The sampled ids' logprobs, one per id (empty when none were asked for)."""
        if self.logprobs is None or self.logprobs.content is None:
            return []
        return [entry.logprob for entry in self.logprobs.content]


class GenerateResult(ServerModel):
    request_id: str
    model: str | None = None
    created: int | None = None
    choices: list[GenerateChoice]
    usage: dict[str, Any] | None = None
    prompt_logprobs: list[Any] | None = None


class GenerateChunk(ServerModel):
    """One streamed event of /inference/v1/generate: deltas, or the last one with usage."""

    request_id: str = ""
    choices: list[GenerateChoice] = Field(default_factory=list)
    usage: dict[str, Any] | None = None


class ChatMessageOut(ServerModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def for_history(self) -> dict[str, Any]:
        """The message to send back in a conversation (no duplicate ``reasoning`` name)."""
        message = self.model_dump(exclude_none=True)
        message.pop("reasoning", None)
        return message


class ChatChoice(ServerModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletion(ServerModel):
    id: str
    created: int | None = None
    model: str | None = None
    choices: list[ChatChoice]
    usage: dict[str, Any] | None = None


class CompletionChoice(ServerModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class Completion(ServerModel):
    id: str
    created: int | None = None
    model: str | None = None
    choices: list[CompletionChoice]
    usage: dict[str, Any] | None = None


class Tokens(ServerModel):
    """/tokenize's answer."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None
