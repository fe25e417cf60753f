"""Constraints compiled with llguidance, and the per-request state that masks a sampler's row.

Why llguidance (bench/bench_structured.py, NOTES-structured.md): its per-token mask on the
Qwen3 vocabulary costs tens of microseconds with no ahead-of-time work per schema, its wheel
needs nothing but itself (no torch pin), and it covers the most of JSON Schema.

Ownership: the pipeline compiles a ``Constraint`` once per distinct constraint (cached, off
the event loop on this module's own worker thread, within a time cap) into a
``CompiledGrammar``: an immutable handle holding a matcher in its start state, which the
request's ``SamplingParams`` carries. The engine's row sampler calls ``new_state()`` once per
request (a deep copy of that matcher): the ``GrammarState`` it gets is the request's only
grammar state, advanced by the tokens the row samples.

End of text: llguidance knows one eos id (the tokenizer's); when its mask allows it, every id
that ends a choice on the engine's side (the model's eos ids) is allowed too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from tokenwire.structured.spec import Constraint
from tokenwire.structured.tool_choice import tool_calls_lark

logger = logging.getLogger(__name__)

# A constraint that takes longer than this to compile is refused (400); its compile goes on in
# the background and lands in the cache.
COMPILE_TIMEOUT_S = 10.0
CACHE_SIZE = 256
# JSON's whitespace between tokens unless a request gives its own pattern (or asks for compact
# JSON): one space, or a newline and up to 20 spaces or tabs of indent (llama.cpp's bound).
# Unbounded, a model that likes whitespace (any random-weights model) never gets past the
# first brace: Qwen3 has hundreds of whitespace tokens against a handful that make progress.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"


MAX_ERROR_CHARS = 500  # llguidance's messages can carry a dump of its parser state


class GrammarError(ValueError):
    """A constraint llguidance refuses (invalid schema, regex or grammar, a compile past the
    time cap); the message says why."""

    def __init__(self, message: str) -> None:
        super().__init__(message[:MAX_ERROR_CHARS])


def _no_additional_properties(schema: Any) -> Any:
    """vLLM's ``disable_additional_properties``: objects with listed properties and no
    ``additionalProperties`` get ``false``."""
    if isinstance(schema, list):
        return [_no_additional_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if "additionalProperties" not in out and isinstance(out.get("properties"), dict):
        out["additionalProperties"] = False
    return out


def grammar_text(constraint: Constraint, added_tokens: frozenset[str] = frozenset()) -> str:
    """The llguidance grammar (its JSON form) of ``constraint``, after the model's reasoning
    where ``constraint.reasoning`` says so. ``added_tokens``: the tokenizer's added tokens
    (tags among them are matched as their single tokens)."""
    body = _body_text(constraint, added_tokens)
    if constraint.reasoning == "none":
        return body
    # The body becomes a subgrammar behind a reasoning block. The think tags are matched as
    # their single tokens (the server only asks for this where the tokenizer has them), so
    # the free text inside cannot end the block by spelling a tag in pieces.
    # llguidance's grammar texts are its JSON form, or Lark as is.
    sub = json.loads(body)["grammars"][0] if body.startswith("{") else {"lark_grammar": body}
    sub["name"] = "body"
    block = (
        "THINK </think> GAP" if constraint.reasoning == "open" else "(<think> THINK </think> GAP)?"
    )
    lark = f"start: {block} @body\nTHINK: /(?s:.*)/\nGAP: /[ \\t\\n]*/"
    return json.dumps({"grammars": [{"lark_grammar": lark}, sub]})


def _json_options(constraint: Constraint) -> dict[str, Any]:
    options: dict[str, Any] = {"whitespace_flexible": constraint.any_whitespace}
    if constraint.any_whitespace:
        options["whitespace_pattern"] = constraint.whitespace_pattern or JSON_WHITESPACE
    return options


def _body_text(constraint: Constraint, added_tokens: frozenset[str]) -> str:
    import llguidance

    matcher = llguidance.LLMatcher
    if constraint.kind == "json":
        schema = json.loads(constraint.value)
        if not constraint.additional_properties:
            schema = _no_additional_properties(schema)
        try:
            return matcher.grammar_from_json_schema(schema, defaults=_json_options(constraint))  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
    if constraint.kind == "regex":
        return matcher.grammar_from_regex(constraint.value)
    if constraint.kind == "choice":
        choices = json.loads(constraint.value)
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if constraint.kind == "tool_calls":
        return matcher.grammar_from_lark(
            tool_calls_lark(constraint.value, _json_options(constraint), added_tokens)
        )
    try:  # Lark (llguidance's dialect) or GBNF / EBNF (llama.cpp's, xgrammar's): converted
        return llguidance.grammar_from("grammar", constraint.value)
    except (ValueError, TypeError, KeyError) as exc:
        raise GrammarError(f"invalid grammar: {exc}") from None


class CompiledGrammar:
    """A compiled constraint: shared by every request with an equal one, never mutated."""

    def __init__(self, text: str, prototype: Any, vocab_size: int, eos: int, ends: Any) -> None:
        self.text = text  # llguidance's grammar: what another process compiles it from
        self._prototype = prototype  # an LLMatcher in its start state; only ever copied
        self.vocab_size = vocab_size
        self.eos = eos  # llguidance's eos id
        self.ends = ends  # np.ndarray of the engine's eos ids, allowed where ``eos`` is
        self.end_ids = frozenset(int(i) for i in ends)

    def new_state(self) -> GrammarState:
        """A fresh matcher for one request (its only owner advances it)."""
        return GrammarState(self, self._prototype.deep_copy())


class GrammarState:
    """One request's position in its grammar: the next token's allowed set, then advanced by
    the sampled token. Touched by the engine thread only."""

    __slots__ = ("_buf", "grammar", "matcher", "warned")

    def __init__(self, grammar: CompiledGrammar, matcher: Any) -> None:
        self.grammar = grammar
        self.matcher = matcher
        self._buf = np.zeros((grammar.vocab_size + 31) // 32, dtype=np.int32)
        self.warned = False

    def bitmask(self) -> np.ndarray:
        """The ids allowed next: int32 words over the model's vocabulary (a fresh array)."""
        buf = self._buf
        self.matcher.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
        words = buf.view(np.uint32)
        g = self.grammar
        if words[g.eos >> 5] >> np.uint32(g.eos & 31) & 1:
            for end in g.end_ids:
                words[end >> 5] |= np.uint32(1 << (end & 31))
        self._check()
        return buf.copy()

    def allowed(self) -> np.ndarray:
        """The ids allowed next, as a bool array (for checks; the sampler reads ``bitmask``)."""
        bits = np.unpackbits(self.bitmask().view(np.uint8), bitorder="little")
        return bits[: self.grammar.vocab_size].view(np.bool_)

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token (an end-of-text id ends the request: nothing to do)."""
        g = self.grammar
        if token_id == g.eos or token_id in g.end_ids:
            return
        self.matcher.consume_token(token_id)
        self._check()

    def _check(self) -> None:
        if not self.warned and self.matcher.is_error():
            # llguidance then allows only eos: the request ends rather than fail the batch.
            self.warned = True
            logger.warning("structured output matcher error: %s", self.matcher.get_error())


class GrammarCompiler:
    """Compiles constraints for one tokenizer, each distinct one once (LRU cache), on its own
    worker thread so that a huge schema stalls neither the event loop nor other requests'
    text work."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        *,
        timeout_s: float = COMPILE_TIMEOUT_S,
        cache_size: int = CACHE_SIZE,
    ) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        ends = sorted(i for i in eos_token_ids if 0 <= i < vocab_size)
        self._ends = np.array(ends, dtype=np.int64)
        self.timeout_s = timeout_s
        self._cache: OrderedDict[tuple[Any, ...], CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._inflight: dict[tuple[Any, ...], asyncio.Future[CompiledGrammar]] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenwire-grammar")
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        # Tags the grammars match as their single tokens where the tokenizer has them.
        self.added_tokens = frozenset(hf_tokenizer.get_added_vocab())

    @property
    def has_think_tokens(self) -> bool:
        """Whether a constraint can start after reasoning (``Constraint.reasoning``): the
        think tags are single tokens here."""
        return {"<think>", "</think>"} <= self.added_tokens

    def tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built on first use (about a second)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf, self.vocab_size)
            return self._ll_tokenizer

    def compile_now(self, constraint: Constraint) -> CompiledGrammar:
        """Compile on this thread (no cache): the worker's job, and benches'."""
        try:
            text = grammar_text(constraint, self.added_tokens)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(str(exc)) from None
        return self.compile_text(text)

    def compile_text(self, text: str) -> CompiledGrammar:
        """Compile llguidance's grammar ``text`` (``grammar_text``) on this thread."""
        import llguidance

        tok = self.tokenizer()
        try:
            error = llguidance.LLMatcher.validate_grammar(text, tok)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(str(exc)) from None
        if error:
            raise GrammarError(error)
        matcher = llguidance.LLMatcher(tok, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        compiled = CompiledGrammar(text, matcher, self.vocab_size, tok.eos_token, self._ends)
        # The first mask builds the lexer's start states: here, not on the engine thread.
        probe = compiled.new_state()
        probe.bitmask()
        if probe.matcher.is_error():
            raise GrammarError(probe.matcher.get_error())
        return compiled

    async def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled ``constraint``, from the cache or the worker; ``GrammarError`` when
        llguidance refuses it or it takes longer than ``timeout_s``."""
        return await self._cached(constraint.key, self.compile_now, constraint)

    async def compile_grammar(self, text: str) -> CompiledGrammar:
        """``compile`` for a grammar another process made (``CompiledGrammar.text``)."""
        return await self._cached(("text", text), self.compile_text, text)

    async def _cached(
        self, key: tuple[Any, ...], job: Callable[[Any], CompiledGrammar], arg: Any
    ) -> CompiledGrammar:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        future = self._inflight.get(key)
        if future is None:
            loop = asyncio.get_running_loop()
            future = asyncio.ensure_future(
                asyncio.wrap_future(self._pool.submit(job, arg), loop=loop)
            )
            self._inflight[key] = future
            future.add_done_callback(lambda f: self._landed(key, f))
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            raise GrammarError(
                f"the constraint did not compile within {self.timeout_s:g} s"
            ) from None

    def _landed(self, key: tuple[Any, ...], future: asyncio.Future[CompiledGrammar]) -> None:
        self._inflight.pop(key, None)
        if future.cancelled() or future.exception() is not None:
            return
        self._cache[key] = future.result()
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._pool.shutdown(wait=False, cancel_futures=True)
