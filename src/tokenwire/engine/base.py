"""The contract between the api layer and any engine (hf on CPU/CUDA, remote, vllm).

The api layer only ever sees these types. One engine request is one sequence: the api layer fans
a request with ``n > 1`` out into ``n`` engine requests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling, already validated by the protocol layer."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token + top k
    prompt_logprobs: int | None = None
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The logprob of one chosen token and the top alternatives at its position.

    ``top`` holds (token_id, logprob) pairs sorted by logprob, highest first.
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One processed image of a prompt (Qwen2-VL style) and where its placeholders sit."""

    pixel_values: Any  # torch.Tensor [patches, patch_dim]
    image_grid_thw: Any  # torch.Tensor [1, 3]
    offset: int  # first placeholder token in the prompt
    length: int  # number of placeholder tokens


@dataclass(frozen=True, slots=True)
class MultiModalInput:
    """The media of one request, in prompt order; passed as ``media`` to ``Engine.generate``."""

    images: tuple[ImageInput, ...]


@dataclass(slots=True)
class EngineOutput:
    """An incremental result: the tokens made since the previous output of the same request."""

    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    # Why a "stop" finish happened, as vLLM reports it: the stop token id of a stop_token_ids
    # hit, the stop string (set above the engine), None for eos.
    stop_reason: int | str | None = None
    # Sent once, with the first output: None for the first prompt position.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int
    waiting: int
    max_num_seqs: int
    extra: dict[str, Any] = field(default_factory=dict)


class EngineError(Exception):
    """A request the engine cannot serve (e.g. too long); mapped to a 400 by the api layer."""


class Engine(Protocol):
    """What every engine provides."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # known once started

    async def start(self) -> None: ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        media: MultiModalInput | None = None,
    ) -> AsyncIterator[EngineOutput]:
        """Yield outputs until one carries a finish_reason. Closing the iterator aborts."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Abort a running or queued request; its stream ends with finish_reason "abort"."""
        ...

    def stats(self) -> EngineStats: ...

    def is_ready(self) -> bool: ...

    async def shutdown(self) -> None: ...
