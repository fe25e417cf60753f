"""The real Qwen3 tokenizer, rebuilt from llama.cpp's ``ggml-vocab-qwen2.gguf``.

The GGUF carries Qwen2's byte-level BPE (151643 regular tokens, 151387 merges) plus three
control tokens and ``[PAD…]`` fillers up to 151936.  We keep ids < 151643 and append
Qwen3's 26 added tokens, giving the 151669 tokens of the released Qwen3 tokenizer.  The
pipeline (NFC, Qwen2 split regex, byte-level) mirrors Qwen's ``tokenizer.json``; it is
assembled with ``tokenizers`` directly rather than via transformers' GGUF conversion,
which drops the NFC normaliser and takes ~25 s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .gguf_meta import read_gguf_metadata

VOCAB_GGUF = "ggml-vocab-qwen2.gguf"
BASE_VOCAB_SIZE = 151643

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
NON_SPECIAL_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
ADDED_TOKENS: tuple[str, ...] = SPECIAL_TOKENS + NON_SPECIAL_TOKENS
VOCAB_SIZE = BASE_VOCAB_SIZE + len(ADDED_TOKENS)  # 151669

TOKEN_IDS: dict[str, int] = {tok: BASE_VOCAB_SIZE + i for i, tok in enumerate(ADDED_TOKENS)}
ENDOFTEXT_ID = TOKEN_IDS["<|endoftext|>"]  # 151643, pad / bos
IM_END_ID = TOKEN_IDS["<|im_end|>"]  # 151645, eos

PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CASE_SEPARATOR = "\n__ggml_vocab_test__\n"


def load_reference_cases(models_dir: Path, vocab: str = VOCAB_GGUF) -> list[tuple[str, list[int]]]:
    """llama.cpp's reference tokenisations: ``(text, ids)`` pairs from ``.inp`` / ``.out``.

    The ``.inp`` file is every text followed by ``\\n__ggml_vocab_test__\\n``; the ``.out``
    file has one line of space-separated ids per text (``add_special_tokens=False``).
    """
    # Decode bytes ourselves: read_text() would translate "\r\n" inside the texts.
    inp = (models_dir / f"{vocab}.inp").read_bytes().decode("utf-8")
    out = (models_dir / f"{vocab}.out").read_bytes().decode("utf-8")
    texts = inp.split(_CASE_SEPARATOR)
    if texts[-1] != "":
        raise ValueError(f"{vocab}.inp does not end with the case separator")
    texts = texts[:-1]
    lines = out.split("\n")
    if lines[-1] == "":
        lines = lines[:-1]
    if len(texts) != len(lines):
        raise ValueError(f"{vocab}: {len(texts)} inputs but {len(lines)} outputs")
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines, strict=True)]


def _build_tokenizer_json(gguf_path: Path) -> Any:
    """A ``tokenizers.Tokenizer`` equal to Qwen3's ``tokenizer.json``."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from tokenizers.models import BPE

    meta = read_gguf_metadata(gguf_path)
    if meta.get("tokenizer.ggml.model") != "gpt2" or meta.get("tokenizer.ggml.pre") != "qwen2":
        raise ValueError(f"{gguf_path.name} is not a Qwen2 byte-level BPE vocabulary")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta["tokenizer.ggml.token_type"]
    # Sanity: ids < 151643 are all NORMAL (1); the next three are the control tokens that
    # Qwen3 keeps at the same ids.
    if any(t != 1 for t in types[:BASE_VOCAB_SIZE]):
        raise ValueError("unexpected non-normal token below id 151643")
    if tokens[BASE_VOCAB_SIZE : BASE_VOCAB_SIZE + 3] != list(ADDED_TOKENS[:3]):
        raise ValueError("GGUF control tokens differ from Qwen's <|endoftext|>/<|im_*|>")
    vocab = {tok: i for i, tok in enumerate(tokens[:BASE_VOCAB_SIZE])}
    if len(vocab) != BASE_VOCAB_SIZE:
        raise ValueError("duplicate tokens in the GGUF vocabulary")
    merges: list[tuple[str, str]] = []
    for m in meta["tokenizer.ggml.merges"]:
        left, sep, right = m.partition(" ")
        if not sep or " " in right:
            raise ValueError(f"malformed merge {m!r}")
        merges.append((left, right))

    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    # add_tokens assigns consecutive ids after the base vocabulary, in this order.
    tok.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
        + [AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL_TOKENS]
    )
    for text, want in TOKEN_IDS.items():
        if tok.token_to_id(text) != want:
            raise ValueError(f"{text} got id {tok.token_to_id(text)}, expected {want}")
    return tok


def _tokenizer_config(chat_template: str, model_max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` in the shape Qwen ships it."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(TOKEN_IDS[t]): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": t in SPECIAL_TOKENS,
            }
            for t in ADDED_TOKENS
        },
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_qwen_tokenizer(
    models_dir: Path, out: Path, *, chat_template: str, model_max_length: int
) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja``.

    The template goes into both files: transformers prefers ``chat_template.jinja``, other
    tools read ``tokenizer_config.json``; both hold the same text.
    """
    tok = _build_tokenizer_json(models_dir / VOCAB_GGUF)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    cfg = _tokenizer_config(chat_template, model_max_length)
    (out / "tokenizer_config.json").write_text(
        json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")


def check_qwen_tokenizer(model_dir: Path, models_dir: Path) -> None:
    """Reload through transformers and compare with llama.cpp's reference tokenisations."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if len(tok) != VOCAB_SIZE:
        raise AssertionError(f"tokenizer has {len(tok)} tokens, expected {VOCAB_SIZE}")
    if tok.eos_token_id != IM_END_ID or tok.pad_token_id != ENDOFTEXT_ID:
        raise AssertionError(f"eos/pad ids {tok.eos_token_id}/{tok.pad_token_id}")
    for text, want in load_reference_cases(models_dir):
        got = tok.encode(text, add_special_tokens=False)
        if got != want:
            raise AssertionError(f"tokenisation of {text!r}: {got} != reference {want}")
    if tok.decode([IM_END_ID]) != "<|im_end|>":
        raise AssertionError("added tokens do not decode")
