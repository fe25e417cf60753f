"""Structured outputs: which grammar engine, and what a constraint costs the hf engine.

Part 1 (``grammar``, the default): llguidance and xgrammar (each if installed) on the Qwen3
vocabulary (qwen3-tiny's tokenizer, 151,936 logits): the compile time of a JSON schema, the
per-token mask cost along a valid instance of it (mask, then consume the token), and JSON
Schema coverage: per keyword, whether a valid instance is accepted and one violating the
keyword is refused, token by token. Prints the xgrammar / llguidance mask-cost ratio.

Part 2 (``--engine``): the hf engine on qwen3-tiny (random weights), 32 concurrent requests of
``--tokens`` each, free vs constrained by the same schema, same run: process CPU seconds per
output token and the ratio (the design target is at most 1.15x).

Usage: ``python bench/bench_structured.py [--engine] [--tokens 64] [--concurrency 32]
[--trials 3] [--smoke]``. On a loaded 2-core machine single trials vary by 30%: read the median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from transformers import AutoTokenizer

from tokenwire.assets import prepare

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
INSTANCE = (
    '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", '
    '"tags": ["math", "poet"], "address": {"city": "London", "zip": "W1"}, "role": "admin"}'
)

# (keyword, schema, a valid instance, an instance that breaks only that keyword)
COVERAGE: list[tuple[str, dict[str, Any], str, str]] = [
    ("type", {"type": "integer"}, "12", '"12"'),
    ("enum", {"enum": ["a", "b"]}, '"a"', '"c"'),
    ("const", {"const": 3}, "3", "4"),
    ("minimum/maximum", {"type": "integer", "minimum": 1, "maximum": 9}, "5", "12"),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, "0.5", "0"),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, "15", "16"),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, '"ab"', '"abcd"'),
    ("pattern", {"type": "string", "pattern": "^[a-z]+[0-9]$"}, '"ab1"', '"ab"'),
    ("format: date", {"type": "string", "format": "date"}, '"2024-01-31"', '"tomorrow"'),
    ("format: email", {"type": "string", "format": "email"}, '"a@b.co"', '"nope"'),
    (
        "required",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        '{"a": 1}',
        "{}",
    ),
    (
        "additionalProperties: false",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
        '{"a": 1}',
        '{"a": 1, "b": 2}',
    ),
    (
        "additionalProperties: schema",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        '{"x": 1}',
        '{"x": "1"}',
    ),
    (
        "patternProperties",
        {
            "type": "object",
            "patternProperties": {"^n_": {"type": "integer"}},
            "additionalProperties": False,
        },
        '{"n_a": 1}',
        '{"n_a": "x"}',
    ),
    (
        "minProperties",
        {"type": "object", "minProperties": 1},
        '{"a": 1}',
        "{}",
    ),
    ("items", {"type": "array", "items": {"type": "integer"}}, "[1, 2]", '[1, "2"]'),
    (
        "prefixItems",
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
        '[1, "a"]',
        "[1, 2]",
    ),
    ("minItems/maxItems", {"type": "array", "minItems": 1, "maxItems": 2}, "[1]", "[1, 2, 3]"),
    ("uniqueItems", {"type": "array", "uniqueItems": True}, "[1, 2]", "[1, 1]"),
    (
        "anyOf",
        {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
        "true",
        '"x"',
    ),
    (
        "oneOf",
        {"oneOf": [{"type": "integer"}, {"type": "string"}]},
        '"x"',
        "null",
    ),
    (
        "allOf",
        {"allOf": [{"type": "integer"}, {"minimum": 3}]},
        "4",
        "2",
    ),
    (
        "$ref/$defs",
        {
            "$defs": {"n": {"type": "integer"}},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/n"}},
            "required": ["a"],
        },
        '{"a": 1}',
        '{"a": "1"}',
    ),
    (
        "recursive $ref",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
                    },
                    "required": ["v", "next"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        '{"v": 1, "next": {"v": 2, "next": null}}',
        '{"v": 1, "next": {"v": "2", "next": null}}',
    ),
    ("not", {"not": {"type": "string"}}, "1", '"a"'),
    (
        "if/then/else",
        {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
        "1",
        "-1",
    ),
    (
        "dependentRequired",
        {"type": "object", "dependentRequired": {"a": ["b"]}},
        '{"a": 1, "b": 2}',
        '{"a": 1}',
    ),
]


def timed(fn: Any) -> tuple[Any, float]:
    began = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - began


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import numpy as np

        self.ll, self.np = llguidance, np
        self.tok, self.setup_s = timed(lambda: llguidance.hf.from_tokenizer(hf, vocab))
        self.buf = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": True}
        )
        error = self.ll.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.ll.LLMatcher(self.tok, compiled, log_level=0)

    def mask(self, m: Any) -> None:
        m.unsafe_compute_mask_ptr(self.buf.ctypes.data, self.buf.nbytes)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token))

    def accepts_all(self, m: Any, tokens: list[int]) -> bool:
        return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info, self.setup_s = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.buf = xgr.allocate_token_bitmask(1, vocab)
        self.eos = hf.eos_token_id

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, m: Any) -> None:
        m.fill_next_token_bitmask(self.buf, 0)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))

    def accepts_all(self, m: Any, tokens: list[int]) -> bool:
        return all(m.accept_token(t) for t in tokens) and bool(m.accept_token(self.eos))


def grammar_part(hf: Any, vocab: int) -> None:
    engines = []
    for cls in (LLGuidance, XGrammar):
        try:
            engines.append(cls(hf, vocab))
        except ImportError:
            print(f"{cls.name}: not installed, skipped")
    tokens = hf.encode(INSTANCE, add_special_tokens=False)
    per_token: dict[str, float] = {}
    for eng in engines:
        compiled, compile_s = timed(lambda eng=eng: eng.compile(SCHEMA))
        samples = []
        for _ in range(5):
            m = eng.matcher(compiled)
            for t in tokens:
                began = time.perf_counter()
                eng.mask(m)
                ok = eng.accept(m, t)
                samples.append(time.perf_counter() - began)
                assert ok, f"{eng.name} refused a token of a valid instance"
        per_token[eng.name] = statistics.mean(samples)
        enforced = []
        for keyword, schema, good, bad in COVERAGE:
            try:
                c = eng.compile(schema)
                ok_good = eng.accepts_all(eng.matcher(c), hf.encode(good, add_special_tokens=False))
                ok_bad = eng.accepts_all(eng.matcher(c), hf.encode(bad, add_special_tokens=False))
                verdict = "enforced" if ok_good and not ok_bad else "not enforced"
                if not ok_good:
                    verdict = "refuses a valid instance"
            except Exception as exc:  # a keyword the engine refuses outright
                verdict = f"compile error ({str(exc).splitlines()[0][:60]})"
            enforced.append(verdict == "enforced")
            print(f"  {eng.name:10s} {keyword:30s} {verdict}")
        print(
            f"{eng.name}: tokenizer setup {eng.setup_s * 1e3:.0f} ms, schema compile "
            f"{compile_s * 1e3:.1f} ms, mask+accept per token {per_token[eng.name] * 1e6:.1f} us "
            f"(mean of {len(samples)}), p99 "
            f"{sorted(samples)[int(len(samples) * 0.99)] * 1e6:.1f} us, JSON Schema coverage "
            f"{sum(enforced)}/{len(COVERAGE)} keywords enforced"
        )
    if len(per_token) == 2:
        ratio = per_token["xgrammar"] / per_token["llguidance"]
        print(f"mask cost ratio xgrammar/llguidance: {ratio:.2f}")


async def engine_part(model_dir: Any, tokens: int, concurrency: int, trials: int = 3) -> None:
    """Free vs constrained decoding on the hf engine, same run: CPU per output token."""
    from tokenwire.engine.base import SamplingParams
    from tokenwire.engine.hf.engine import HFEngine
    from tokenwire.structured.grammar import GrammarCompiler
    from tokenwire.structured.spec import constraint_of

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    engine = HFEngine(model_dir, max_num_seqs=concurrency)
    await engine.start()
    compiler = GrammarCompiler(hf, engine.vocab_size, engine.eos_token_ids)
    began = time.perf_counter()
    grammar = await compiler.compile(constraint_of({"json": SCHEMA}))
    print(f"schema compile (first, with tokenizer setup) {(time.perf_counter() - began):.2f} s")
    began = time.perf_counter()
    await compiler.compile(constraint_of({"json": {**SCHEMA, "title": "other"}}))
    print(f"schema compile (tokenizer ready) {(time.perf_counter() - began) * 1e3:.1f} ms")
    prompt = hf.encode("Describe a person as JSON:", add_special_tokens=False)

    async def run(tag: str, lengths: list[int] | None) -> tuple[float, list[int], float]:
        """One request per slot, all at once: constrained by the schema (``lengths`` None), or
        free with each request's length given (the same lengths: the same batch shapes)."""

        async def one(i: int) -> int:
            if lengths is None:
                params = SamplingParams(max_tokens=tokens, temperature=1.0, grammar=grammar)
            else:
                params = SamplingParams(max_tokens=lengths[i], temperature=1.0, ignore_eos=True)
            n = 0
            async for out in engine.generate(f"{tag}-{i}", prompt, params):
                n += len(out.new_token_ids)
            return n

        cpu, wall = time.process_time(), time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(concurrency)))
        return time.process_time() - cpu, list(counts), time.perf_counter() - wall

    await run("warm", [8] * concurrency)
    ratios = []
    for trial in range(trials):
        cpu_json, counts, wall_json = await run(f"json{trial}", None)
        cpu_free, _, wall_free = await run(f"free{trial}", counts)
        n = sum(counts)
        print(
            f"trial {trial}: {n} tokens each run; json_schema "
            f"{cpu_json / n * 1e3:.2f} ms CPU/token "
            f"({wall_json:.2f} s), free {cpu_free / n * 1e3:.2f} ms CPU/token ({wall_free:.2f} s)"
        )
        ratios.append(cpu_json / cpu_free)
    print(
        f"CPU per output token, json_schema / free: median {statistics.median(ratios):.2f}x, "
        f"best {min(ratios):.2f}x (trials: {', '.join(f'{r:.2f}' for r in ratios)}; "
        "target <= 1.15x)"
    )
    await engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", action="store_true", help="also run the hf engine part")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument(
        "--smoke", action="store_true", help="seconds: both parts at tiny sizes, one trial"
    )
    args = parser.parse_args()
    if args.smoke:
        args.engine, args.tokens, args.concurrency, args.trials = True, 8, 4, 1
    model_dir = prepare("qwen3-tiny")
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    grammar_part(hf, vocab)
    if args.engine:
        asyncio.run(engine_part(model_dir, args.tokens, args.concurrency, args.trials))


if __name__ == "__main__":
    main()
