"""``qwen3-moe-tiny``: the real Qwen3 tokenizer and template on a tiny seeded Qwen3-MoE.

For mixture-of-experts paths: routed-experts capture and replay. Every decoder layer is sparse
(8 experts, top 2), so the routing has one row per layer. The router weights are drawn wider
than transformers' default (std 0.02), which would leave the eight router logits within ~1e-3
of each other: a top-k that flips on float noise between a batched and a single forward would
make routing tests depend on batch shape rather than on the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cache import Progress, library_versions, quiet
from .qwen3_tiny import (
    CHAT_TEMPLATE,
    save_generation_config,
    text_config_kwargs,
    write_qwen3_tokenizer,
)
from .sources import LLAMA_CPP_SDIST, LLAMA_CPP_SDIST_SHA256

NAME = "qwen3-moe-tiny"
RECIPE = 1
SEED = 0
NUM_EXPERTS = 8
TOP_K = 2
MOE_INTERMEDIATE_SIZE = 32
# Router logits' spread: top-2 gaps of order 1, far above fp32 noise (~1e-6).
ROUTER_STD = 0.5


def moe_config_kwargs() -> dict[str, Any]:
    """The tiny Qwen3-MoE shape: ``qwen3-tiny``'s attention and embeddings, sparse MLPs."""
    return {
        **text_config_kwargs(),
        "head_dim": 16,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": MOE_INTERMEDIATE_SIZE,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def build(out: Path, progress: Progress | None = None) -> dict[str, Any]:
    """Write the model directory into the empty directory ``out``."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    progress = progress or quiet
    write_qwen3_tokenizer(out, NAME, progress)
    progress(f"{NAME}: initialising tiny weights (seed {SEED})")
    config = Qwen3MoeConfig(
        **moe_config_kwargs(),
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    torch.manual_seed(SEED)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, ROUTER_STD)
    model.save_pretrained(str(out))
    save_generation_config(out)
    return {
        "sources": {LLAMA_CPP_SDIST: LLAMA_CPP_SDIST_SHA256},
        "chat_template": CHAT_TEMPLATE,
        "seed": SEED,
        "versions": library_versions(),
    }
