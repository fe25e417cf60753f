"""The front middleware's body checks on a long /extend body: time per body, before and after.

The body of a 74K-token multi-turn episode sent to /v1/chat/completions/extend as Python's
``json.dumps`` writes it (``ensure_ascii``: every non-ASCII character an escape, emoji as
surrogate pairs): its previous ids and the messages they render, in two kinds of text: typical
(English with a non-ASCII word in fifty, an emoji in a thousand) and dense (every other word
non-ASCII, an emoji in eleven: ~10K surrogate pairs). Timed in this process: the
surrogate checks of ``api.asgi`` (lone escaped surrogate, surrogate encoded in UTF-8) against
the previous check, a regex with a lookbehind and so no literal prefix, which tried every byte
of any body that held a ``\\u`` escape. Target: the checks at most 1 ms. Both must refuse a
lone surrogate and accept the pairs (checked, exit 1 otherwise).

Usage: ``python bench/bench_body_checks.py [--tokens 74000] [--repeat 20] [--smoke]``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections.abc import Callable

from tokenwire.api.asgi import has_encoded_surrogate, has_lone_surrogate

ASCII_WORDS = ["the", "model", "returns", "a", "tool", "call", "with", "its", "arguments", "ok"]
# Non-ASCII a chat carries: accents, curly quotes, CJK, dashes, emoji.
NON_ASCII = ["réponse", "“quoted”", "naïve", "数据", "—"]
EMOJI = "🦩"
# Per kind of text: (non-ASCII words, emoji) in every 1,000 words.
TEXTS = {"typical": (20, 1), "dense": (500, 91)}
CHARS_PER_TOKEN = 4

# The check before (for comparison only): the lookbehind leaves the regex no literal prefix.
_OLD_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u[dD]([89abAB]|[c-fC-F])[0-9a-fA-F]{2}")
_OLD_HIGH = frozenset(b"89abAB")


def old_has_lone_surrogate(body: bytes) -> bool:
    if b"\\u" not in body:
        return False
    pending_high_end = -1
    for match in _OLD_ESCAPE.finditer(body):
        start = match.end() - 6
        is_high = match.group(1)[0] in _OLD_HIGH
        if pending_high_end != -1:
            if is_high or start != pending_high_end:
                return True
            pending_high_end = -1
        elif is_high:
            pending_high_end = match.end()
        else:
            return True
    return pending_high_end != -1


def episode_body(tokens: int, kind: str, rng: random.Random) -> bytes:
    """An /extend request of a ``tokens``-token episode of 8 turns, as json.dumps writes it."""
    non_ascii, emoji = TEXTS[kind]

    def word() -> str:
        draw = rng.randrange(1000)
        if draw < emoji:
            return EMOJI
        return rng.choice(NON_ASCII if draw < emoji + non_ascii else ASCII_WORDS)

    def text(n_tokens: int) -> str:
        return " ".join(word() for _ in range(n_tokens * CHARS_PER_TOKEN // 5))

    turns = 8
    previous = [{"role": "system", "content": "You are a careful agent."}]
    for _ in range(turns):
        previous.append({"role": "user", "content": text(tokens // turns // 4)})
        previous.append({"role": "assistant", "content": text(3 * tokens // turns // 4)})
    body = {
        "previous_token_ids": [rng.randrange(150_000) for _ in range(tokens)],
        "previous_messages": previous,
        "messages": [*previous, {"role": "user", "content": "Go on."}],
    }
    return json.dumps(body).encode()


def both(body: bytes) -> bool:
    return has_lone_surrogate(body) or has_encoded_surrogate(body)


ROWS: list[tuple[str, Callable[[bytes], bool]]] = [
    ("lone escaped surrogate, before", old_has_lone_surrogate),
    ("lone escaped surrogate, now", has_lone_surrogate),
    ("surrogate encoded in UTF-8, now", has_encoded_surrogate),
    ("both checks, now (the front's)", both),
]


def best_ms(check: Callable[[bytes], bool], body: bytes, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        check(body)
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=74_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.repeat = 2_000, 3
    for kind in TEXTS:
        body = episode_body(args.tokens, kind, random.Random(0))
        lone = body.replace(b"\\ud83e\\udda9", b"\\ud83e", 1)  # one flamingo's high half alone
        for check in (has_lone_surrogate, old_has_lone_surrogate):
            if check(body) or not check(lone):
                print(f"{check.__name__} is wrong on the {kind} episode body")
                return 1
        escapes = body.count(b"\\u")
        print(
            f"/extend body of a {args.tokens:,}-token episode, {kind} text: "
            f"{len(body) / 1e6:.2f} MB, {escapes:,} \\u escapes; best of {args.repeat}"
        )
        for name, check in ROWS:
            print(f"  {name:34s} {best_ms(check, body, args.repeat):8.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
