"""Stop strings over a token stream, decoded incrementally.

Only the tokens since the last emitted text are re-decoded per step (vLLM's prefix/read
offsets), so a long output costs O(n) overall, and a byte-level token that ends mid-character
waits for the rest before its text counts.
"""

from __future__ import annotations

from tokenwire.text.tokenizer import Tokenizer


class StopStringMatcher:
    """Feed output ids; says when the decoded text first contains one of the stop strings."""

    def __init__(
        self, tokenizer: Tokenizer, stops: list[str], *, skip_special_tokens: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.skip_special_tokens = skip_special_tokens
        self.longest = max(len(stop) for stop in stops)
        self.ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def feed(self, token_id: int) -> bool:
        """Add one token; True when a stop string is now complete."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = decode(
            self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip
        )
        full_text = decode(self.ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return False  # nothing new yet, or a character still incomplete
        searched_from = max(0, len(self.text) - self.longest + 1)
        self.text += full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return any(self.text.find(stop, searched_from) != -1 for stop in self.stops)
