"""Encoding long texts piece by piece, remembering each piece's ids.

HF tokenizers split a text at its added tokens (``<|im_start|>``, ``<|im_end|>``, ...) before
anything else runs: each piece between two of them is normalised, pre-tokenised and merged on
its own, and an added token is always its one id. So a text's ids are its pieces' ids in order,
and a chat render whose earlier messages were encoded before (the previous turn of the same
conversation, the same prompt sampled n times) pays only for its new pieces.

That holds where the added tokens match as plain strings (no ``lstrip``, ``rstrip`` or
``single_word``, not normalised first) and encoding adds nothing to the pieces' ids (no
truncation or padding; special tokens to add only when not asked for): ``for_backend`` builds
an encoder only for such tokenizers (every model tokenwire ships), and the others keep encoding
the whole text.
"""

from __future__ import annotations

import re
import sys
import threading
from collections import OrderedDict

from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

# What the remembered pieces may hold, their text and ids (about 36 bytes per id, kept as a list:
# an array's ids would cost 20x more to copy out): some 7M tokens of conversations.
DEFAULT_MAX_BYTES = 256 * 2**20
_BYTES_PER_ID = 36


class PieceEncoder:
    """``encode(text)`` == the tokenizer's ``encode(text, add_special_tokens=False)``, from
    remembered pieces where it can (least recently used pieces go first)."""

    def __init__(self, backend: RustTokenizer, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        added = {token.content: token_id for token_id, token in _added_tokens(backend)}
        self._backend = backend
        self._added_ids = added
        # Longest first: at one position the longest added token wins, as in the tokenizer.
        alternatives = sorted(added, key=len, reverse=True)
        self._splitter = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
        self._max_bytes = max_bytes
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # encodes run on the offload threads

    @classmethod
    def for_backend(
        cls, backend: RustTokenizer, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> PieceEncoder | None:
        """An encoder for ``backend``, or None where piecewise ids could differ."""
        if backend.truncation is not None or backend.padding is not None:
            return None
        if backend.encode_special_tokens:  # added tokens then encode as text, no split
            return None
        tokens = [token for _, token in _added_tokens(backend)]
        if not tokens:
            return None
        for token in tokens:
            if token.lstrip or token.rstrip or token.single_word:
                return None
            if token.normalized and backend.normalizer is not None:
                return None
        return cls(backend, max_bytes)

    def encode(self, text: str) -> list[int]:
        parts = self._splitter.split(text)  # pieces at even indices, added tokens at odd
        pieces = parts[0::2]
        with self._lock:
            known = {piece: ids for piece in pieces if (ids := self._remembered(piece)) is not None}
        missing = [piece for piece in dict.fromkeys(pieces) if piece not in known]
        if missing:
            encodings = self._backend.encode_batch_fast(missing, add_special_tokens=False)
            with self._lock:
                for piece, encoding in zip(missing, encodings, strict=True):
                    known[piece] = encoding.ids
                    self._remember(piece, encoding.ids)
        token_ids = list(known[pieces[0]])
        added_ids = self._added_ids
        for index in range(1, len(pieces)):
            token_ids.append(added_ids[parts[2 * index - 1]])
            token_ids.extend(known[pieces[index]])
        return token_ids

    def _remembered(self, piece: str) -> list[int] | None:
        ids = self._pieces.get(piece)
        if ids is not None:
            self._pieces.move_to_end(piece)
        return ids

    def _remember(self, piece: str, ids: list[int]) -> None:
        size = _size(piece, ids)
        if size > self._max_bytes or piece in self._pieces:
            return
        self._pieces[piece] = ids
        self._bytes += size
        while self._bytes > self._max_bytes:
            old_piece, old_ids = self._pieces.popitem(last=False)
            self._bytes -= _size(old_piece, old_ids)

    @property
    def remembered_bytes(self) -> int:
        return self._bytes


def _added_tokens(backend: RustTokenizer) -> list[tuple[int, AddedToken]]:
    return list(backend.get_added_tokens_decoder().items())


def _size(piece: str, ids: list[int]) -> int:
    return sys.getsizeof(piece) + _BYTES_PER_ID * len(ids)
