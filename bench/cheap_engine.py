"""The engine that costs nothing, for benches of the frontend: every request is answered at
once from outputs made at start-up (a module of its own so that a spawned process, the core of
``--api-server-count``, can build it by name)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from tests.fake_engine import FakeEngine, Step
from tokenwire.engine.base import EngineOutput, TokenLogprob

OUTPUT = [504, 3575, 282, 4649, 314, 7042, 30, 198]  # "The capital of France is..."
MOST_TOKENS = 512  # the longest output it makes


class CheapEngine(FakeEngine):
    """Answers every request at once from outputs made at start-up: a non-streamed request gets
    one output, as vLLM's final-only mode gives, a streamed one an output per token, each in its
    own turn of the event loop as a real engine's tokens arrive."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        ids = [OUTPUT[i % len(OUTPUT)] for i in range(MOST_TOKENS)]
        self.ids = ids
        self.logprobs: dict[int, list[TokenLogprob]] = {
            k: [Step(token).token_logprob(k) for token in ids] for k in range(6)
        }

    async def generate(  # type: ignore[override]
        self, request_id: str, prompt_token_ids: list[int], sampling: Any, *_: Any, **kw: Any
    ) -> AsyncIterator[EngineOutput]:
        count = sampling.max_tokens
        k = sampling.logprobs
        logprobs = None if k is None else self.logprobs[k]
        steps = [(0, count)] if kw.get("final_only") else [(i, i + 1) for i in range(count)]
        for start, end in steps:
            if start:
                await asyncio.sleep(0)  # a real engine's next token comes in a later turn
            yield EngineOutput(
                self.ids[start:end],
                logprobs=None if logprobs is None else logprobs[start:end],
                finish_reason="length" if end == count else None,
                num_prompt_tokens=len(prompt_token_ids) if start == 0 else 0,
            )
