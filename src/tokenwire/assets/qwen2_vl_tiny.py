"""``qwen2-vl-tiny``: Qwen3's tokenizer on a tiny seeded Qwen2-VL, for multimodal paths.

None of the templates shipped in llama.cpp's ``models/templates`` renders Qwen2-VL image
parts (only Qwen3.5's does, with Qwen3.5's thinking/tool format), so the official
Qwen2-VL-7B-Instruct chat template is embedded below verbatim.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cache import Progress, library_versions, quiet
from .qwen3_tiny import save_generation_config, text_config_kwargs
from .qwen_tokenizer import TOKEN_IDS, check_qwen_tokenizer, write_qwen_tokenizer
from .sources import LLAMA_CPP_SDIST, LLAMA_CPP_SDIST_SHA256, llama_cpp_models_dir

NAME = "qwen2-vl-tiny"
RECIPE = 1
SEED = 0
MODEL_MAX_LENGTH = 32768
IMAGE_TOKEN_ID = TOKEN_IDS["<|image_pad|>"]
VIDEO_TOKEN_ID = TOKEN_IDS["<|video_pad|>"]
VISION_START_TOKEN_ID = TOKEN_IDS["<|vision_start|>"]
VISION_END_TOKEN_ID = TOKEN_IDS["<|vision_end|>"]
# Small images keep multimodal tests fast: at most 32x32 patches (256 merged tokens).
MIN_PIXELS = 56 * 56
MAX_PIXELS = 448 * 448

# Official chat template of Qwen/Qwen2-VL-7B-Instruct.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _config() -> Any:
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config={
            **text_config_kwargs(),
            # M-RoPE splits the head_dim/2 = 8 rotary frequencies over (time, height, width).
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [2, 3, 3],
            },
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "num_heads": 2,
            "mlp_ratio": 2,
            "hidden_size": 64,  # output width = the text model's hidden size
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_TOKEN_ID,
        vision_end_token_id=VISION_END_TOKEN_ID,
        tie_word_embeddings=True,
    )


def _save_image_processor(out: Path) -> None:
    """Write ``preprocessor_config.json`` for the default Qwen2-VL image processor.

    It is saved through the PIL backend (torchvision is not a dependency); the file names
    the canonical ``Qwen2VLImageProcessor``, and ``AutoImageProcessor`` picks the torchvision
    or PIL implementation at load time.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(str(out))


def mm_token_type_ids(input_ids: Any) -> Any:
    """Per-token modality ids (0 text, 1 image, 2 video) that Qwen2-VL's M-RoPE needs."""
    return (input_ids == IMAGE_TOKEN_ID).long() + 2 * (input_ids == VIDEO_TOKEN_ID).long()


def check_image_dependence(model_dir: Path) -> float:
    """Forward two different images through the saved model; return max |Δlogits| (> 0)."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    proc = AutoImageProcessor.from_pretrained(str(model_dir))
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(model_dir)).eval()
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 256, (70, 90, 3), dtype=np.uint8))
    black = Image.new("RGB", (90, 70))
    feats = [proc(images=[img], return_tensors="pt") for img in (noise, black)]
    grid = feats[0]["image_grid_thw"]
    n_tokens = int(grid.prod()) // proc.merge_size**2
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * n_tokens)
    ids = tok(text, return_tensors="pt")
    ids["mm_token_type_ids"] = mm_token_type_ids(ids["input_ids"])
    with torch.no_grad():
        logits = [model(**ids, **f).logits for f in feats]
    if logits[0].shape[-1] != len(tok):
        raise AssertionError("logits width differs from the tokenizer length")
    return float((logits[0] - logits[1]).abs().max())


def build(out: Path, progress: Progress | None = None) -> dict[str, Any]:
    """Write the model directory into the empty directory ``out``."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    progress = progress or quiet
    models = llama_cpp_models_dir(progress=progress)
    progress(f"{NAME}: building the Qwen3 tokenizer")
    write_qwen_tokenizer(
        models, out, chat_template=CHAT_TEMPLATE, model_max_length=MODEL_MAX_LENGTH
    )
    check_qwen_tokenizer(out, models)
    _save_image_processor(out)

    progress(f"{NAME}: initialising tiny weights (seed {SEED})")
    torch.manual_seed(SEED)
    model = Qwen2VLForConditionalGeneration(_config()).eval()
    model.save_pretrained(str(out))
    save_generation_config(out)
    if not check_image_dependence(out) > 0:
        raise AssertionError(f"{NAME}: logits do not depend on the image")
    return {
        "sources": {LLAMA_CPP_SDIST: LLAMA_CPP_SDIST_SHA256},
        "chat_template": "Qwen/Qwen2-VL-7B-Instruct (embedded)",
        "seed": SEED,
        "versions": library_versions(),
    }
