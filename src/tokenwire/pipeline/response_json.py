"""The JSON envelopes every completion-shaped answer shares (OpenAI's and vLLM's)."""

from __future__ import annotations

from typing import Any


def usage_json(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
) -> dict[str, Any]:
    """vLLM's usage; ``prompt_tokens_details`` only when a prefix cache served prompt tokens."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def completion_json(
    *,
    response_id: str,
    kind: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
) -> dict[str, Any]:
    """A ``chat.completion`` or ``text_completion`` response."""
    return {
        "id": response_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_json(prompt_tokens, completion_tokens, cached_tokens),
    }
