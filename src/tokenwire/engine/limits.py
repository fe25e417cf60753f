"""The request checks every engine makes before it queues a sequence.

One place for them, so the hf and vllm engines refuse the same requests with the same words.
"""

from __future__ import annotations

from tokenwire.engine.base import EngineError, SamplingParams


def check_request(
    prompt: list[int], sampling: SamplingParams, *, vocab_size: int, max_model_len: int
) -> None:
    """Raise ``EngineError`` for a prompt or ``max_tokens`` this model cannot serve."""
    if not prompt:
        raise EngineError("the prompt must hold at least one token")
    if any(not 0 <= t < vocab_size for t in prompt):
        raise EngineError(f"prompt token ids must be in [0, {vocab_size})")
    if len(prompt) > max_model_len - 1:
        raise EngineError(
            f"the prompt has {len(prompt)} tokens; this model's maximum context length is "
            f"{max_model_len}, which leaves room for at most {max_model_len - 1} "
            "prompt tokens"
        )
    if sampling.max_tokens < 1:
        raise EngineError("max_tokens must be at least 1")
    if len(prompt) + sampling.max_tokens > max_model_len:
        raise EngineError(
            f"the prompt ({len(prompt)} tokens) plus max_tokens ({sampling.max_tokens}) "
            f"exceeds this model's maximum context length of {max_model_len} tokens"
        )
