"""The model's tokenizer: one object built at start-up and handed to everything that needs ids.

Encoding and decoding go straight to the Rust ``tokenizers`` backend (the transformers wrapper
adds Python overhead per call); the transformers object is kept for what only it knows
(special-token attributes, the chat template source). Long texts are encoded piece by piece
between added tokens, remembering the pieces (``PieceEncoder``): a conversation's next render
encodes only its new messages.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tokenwire.text.piece_encoder import PieceEncoder

# Below this many characters a text is encoded whole: splitting and looking up pieces would cost
# about what encoding them does.
PIECEWISE_MIN_CHARS = 4096


class Tokenizer:
    """Encode, decode and vocabulary facts for one model."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase) -> None:
        self.hf = hf_tokenizer
        backend = getattr(hf_tokenizer, "backend_tokenizer", None) or getattr(
            hf_tokenizer, "_tokenizer", None
        )
        if not isinstance(backend, RustTokenizer):
            raise ValueError("tokenwire needs a fast (Rust) tokenizer")
        self.backend: RustTokenizer = backend
        # Ids the model may emit and the tokenizer can decode.
        self.vocab_size: int = len(hf_tokenizer)
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.pieces = PieceEncoder.for_backend(backend)
        # Special tokens encode adds (a BOS) would sit before the first piece, not in every one.
        self._adds_special_tokens = backend.num_special_tokens_to_add(False) > 0

    @classmethod
    def load(cls, model_dir: Path) -> Tokenizer:
        return cls(AutoTokenizer.from_pretrained(str(model_dir)))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if (
            self.pieces is not None
            and len(text) >= PIECEWISE_MIN_CHARS
            and not (add_special_tokens and self._adds_special_tokens)
        ):
            return self.pieces.encode(text)
        # The batch entry point skips offsets bookkeeping: same ids, about 17% faster here.
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_batch(self, texts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        encodings = self.backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        id_to_token = self.backend.id_to_token
        return [id_to_token(i) for i in ids]

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that ``skip_special_tokens`` drops (added tokens marked special)."""
        return frozenset(
            token_id for token_id, added in self.hf.added_tokens_decoder.items() if added.special
        )

    @cached_property
    def special_tokens_map(self) -> dict[str, str]:
        """``bos_token``, ``eos_token``, ... as strings, for chat templates."""
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        found = {name: getattr(self.hf, name, None) for name in names}
        return {name: str(value) for name, value in found.items() if value is not None}

    def is_valid_id(self, token_id: int) -> bool:
        return 0 <= token_id < self.vocab_size
