"""``qwen3-tiny``: the real Qwen3 tokenizer and chat template on tiny seeded random weights.

Fast to build and load, so tests exercise real Qwen3 tokenisation, special tokens and the
Qwen3 template (thinking, tool calls) without downloading a real checkpoint.  The vocabulary
size equals the tokenizer length, so every id the model can sample decodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cache import Progress, library_versions, quiet
from .qwen_tokenizer import (
    ENDOFTEXT_ID,
    IM_END_ID,
    VOCAB_SIZE,
    check_qwen_tokenizer,
    write_qwen_tokenizer,
)
from .sources import LLAMA_CPP_SDIST, LLAMA_CPP_SDIST_SHA256, llama_cpp_models_dir

NAME = "qwen3-tiny"
RECIPE = 1
CHAT_TEMPLATE = "templates/Qwen-Qwen3-0.6B.jinja"
SEED = 0
MAX_POSITION_EMBEDDINGS = 32768
MODEL_MAX_LENGTH = 131072  # what Qwen3's tokenizer_config.json declares


def text_config_kwargs() -> dict[str, Any]:
    """Tiny decoder shape shared with ``qwen2-vl-tiny``'s language model."""
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
    }


def save_generation_config(out: Path) -> None:
    """``generation_config.json`` that stops on ``<|im_end|>`` and pads with ``<|endoftext|>``."""
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=ENDOFTEXT_ID, eos_token_id=IM_END_ID, pad_token_id=ENDOFTEXT_ID
    ).save_pretrained(str(out))


def write_qwen3_tokenizer(out: Path, name: str, progress: Progress) -> None:
    """The real Qwen3 tokenizer and chat template into ``out`` (asset ``name``), checked."""
    models = llama_cpp_models_dir(progress=progress)
    progress(f"{name}: building the Qwen3 tokenizer from {models.name}/ggml-vocab-qwen2.gguf")
    template = (models / CHAT_TEMPLATE).read_text(encoding="utf-8")
    write_qwen_tokenizer(models, out, chat_template=template, model_max_length=MODEL_MAX_LENGTH)
    check_qwen_tokenizer(out, models)


def build(out: Path, progress: Progress | None = None) -> dict[str, Any]:
    """Write the model directory into the empty directory ``out``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    progress = progress or quiet
    write_qwen3_tokenizer(out, NAME, progress)
    progress(f"{NAME}: initialising tiny weights (seed {SEED})")
    config = Qwen2Config(
        **text_config_kwargs(),
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(str(out))
    save_generation_config(out)
    return {
        "sources": {LLAMA_CPP_SDIST: LLAMA_CPP_SDIST_SHA256},
        "chat_template": CHAT_TEMPLATE,
        "seed": SEED,
        "versions": library_versions(),
    }
