"""Building the engine ``--engine`` names; each kind is imported only when chosen."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from tokenwire.engine.base import Engine
from tokenwire.engine.defaults import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_PREFIX_CACHE_BYTES

EngineKind = Literal["hf", "vllm"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("hf", "vllm")


def create_engine(
    kind: EngineKind,
    model_dir: Path,
    *,
    max_model_len: int | None,
    max_num_seqs: int,
    device: str | None = None,
    dtype: str | None = None,
    extra_args: Sequence[str] = (),
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    max_logprobs: int = 20,
    max_loras: int = 0,
    max_lora_rank: int = 16,
    max_num_batched_tokens: int | None = None,
    engine_threads: int | None = None,
    allow_nonfinite_weights: bool = False,
    logprobs_mode: str = "raw_logprobs",
    return_routed_experts: bool = False,
) -> Engine:
    """An unstarted engine of ``kind``; ``extra_args`` are vLLM engine flags (vllm only).

    ``prefix_cache_bytes`` budgets the hf engine's prefix cache (0: off);
    vLLM sizes its own (``--enable-prefix-caching`` and its KV cache flags).
    ``max_logprobs`` is ``--max-logprobs``, which vLLM's engine checks again itself (the hf
    engine serves any count the pipeline admits). ``allow_nonfinite_weights`` lets a
    checkpoint reload hold NaN or infinity. ``logprobs_mode`` is what vLLM's engine returns
    (``--logprobs-mode``; the hf engine serves either, per request).
    ``max_loras`` > 0 serves LoRA adapters (vLLM's ``--max-loras``; 0: LoRA off).
    ``max_num_batched_tokens`` is ``--max-num-batched-tokens`` (None: the engine's default);
    ``engine_threads`` the hf engine's torch threads (None: ``default_engine_threads()``).
    ``return_routed_experts`` captures an MoE model's routed experts (hf only, for now).
    """
    if engine_threads is not None and kind != "hf":
        raise ValueError("--engine-threads is the hf engine's (vLLM: VLLM_CPU_OMP_THREADS_BIND)")
    if return_routed_experts and kind != "hf":
        raise ValueError(
            "--enable-return-routed-experts is served by the hf engine only for now "
            "(vLLM's own capture is not wired through --engine vllm; vllm-cpu 0.32 cannot "
            "capture: it needs vLLM's Model Runner V2, which needs Triton with a CPU backend)"
        )
    if kind == "vllm":
        from tokenwire.engine.vllm import VLLMEngine

        return VLLMEngine(
            model_dir,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            dtype=dtype,
            extra_args=extra_args,
            max_logprobs=max_logprobs,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_num_batched_tokens=max_num_batched_tokens,
            allow_nonfinite_weights=allow_nonfinite_weights,
            logprobs_mode=logprobs_mode,
        )
    if extra_args:
        raise ValueError(f"engine arguments {list(extra_args)} need --engine vllm")
    from tokenwire.engine.hf import HFEngine

    return HFEngine(
        model_dir,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        device=device,
        dtype=dtype,
        prefix_cache_bytes=prefix_cache_bytes,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        max_num_batched_tokens=max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
        threads=engine_threads,
        allow_nonfinite_weights=allow_nonfinite_weights,
        return_routed_experts=return_routed_experts,
    )
