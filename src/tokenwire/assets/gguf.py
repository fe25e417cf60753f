"""GGUF file -> local Hugging Face directory (fp32 safetensors), converted once and cached.

transformers reads GGUF directly but dequantises on every load (tens of seconds); converting
once makes later loads take about a second. Used by the smollm2 asset and by ``--model X.gguf``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from .cache import Progress, build_once, cache_root, library_versions, quiet

RECIPE = 1
# Keys transformers records about *where* it loaded from; meaningless in the saved copy.
_LOAD_ARTIFACTS = ("is_local", "local_files_only", "name_or_path", "_model_name_or_path")


def tidy_json(path: Path, drop: tuple[str, ...] = _LOAD_ARTIFACTS, **set_: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    for key in drop:
        data.pop(key, None)
    data.update(set_)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_hf_dir(
    gguf: Path, out: Path, progress: Progress, *, model_max_length: int | None = None
) -> None:
    """Convert ``gguf`` into the empty directory ``out``: tokenizer, template, fp32 weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress(f"{gguf.name}: converting the GGUF tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if model_max_length is not None:
        tokenizer.model_max_length = model_max_length
    progress(f"{gguf.name}: dequantising to fp32 (tens of seconds)")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are already dense fp32; forget the GGUF "quantisation" so that
    # save_pretrained accepts the model and config.json has no quantization_config.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    progress(f"{gguf.name}: writing safetensors")
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    del model
    tidy_json(out / "config.json")
    template_file = out / "chat_template.jinja"
    extra = (
        {"chat_template": template_file.read_text(encoding="utf-8")}
        if template_file.is_file()
        else {}
    )
    # Keep the template in tokenizer_config.json too (chat_template.jinja wins in
    # transformers; other tools read the JSON).
    tidy_json(out / "tokenizer_config.json", **extra)


def convert_gguf(path: Path, *, progress: Progress | None = None) -> Path:
    """The cached HF directory for a user's GGUF file (keyed by its path, size and mtime)."""
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    name = f"gguf-{path.stem}-{key}"

    def build(tmp: Path) -> dict[str, Any]:
        write_hf_dir(path, tmp, progress or quiet)
        return {"sources": {str(path): key}, "versions": library_versions()}

    return build_once(
        cache_root() / "models" / name, name=name, recipe=RECIPE, build=build, progress=progress
    )
