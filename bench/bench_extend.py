"""Where /v1/chat/completions/extend spends its time on a long conversation (issue 33, item 1).

The real app over the project's fake engine (qwen3-tiny's tokenizer and template, no weights),
a Qwen3 conversation of ``--turns`` user/assistant pairs (``--words`` words each, some of them
non-ASCII) whose last reply is the previous turn's sampled ids. Timed in this process (process
CPU, best of ``--repeat``), stage by stage, calling the pipeline's own functions: the body's
validation, the four template renders extend compares, the boundary and id checks, the whole
extend with ``keep_history`` (the common RL case), and the full re-encode a client without
``keep_history`` pays when the template renders the history otherwise (Qwen3 does after every
reply). Target of the issue: the whole extend of a 74K-token conversation at most 5 ms.

Usage: ``python bench/bench_extend.py [--turns 56] [--words 600] [--repeat 5] [--smoke]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from starlette.testclient import TestClient

from tests.fake_engine import FakeEngine
from tests.fast_app import weightless_view
from tokenwire.api.app import create_app
from tokenwire.assets import prepare
from tokenwire.pipeline import extend
from tokenwire.pipeline.validation import check_token_ids
from tokenwire.protocol.extend import ExtendRequest
from tokenwire.settings import parse_serve_args

WORDS = [
    "the",
    "model",
    "returns",
    "a",
    "tool",
    "call",
    "with",
    "its",
    "arguments",
    "and",
    "then",
    "réponse",
    "数据",
    "ok",
]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def best_ms(repeat: int, work: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeat):
        began = time.process_time()
        work()
        times.append(time.process_time() - began)
    return min(times) * 1e3


async def best_ms_async(repeat: int, work: Callable[[], Awaitable[Any]]) -> float:
    times = []
    for _ in range(repeat):
        began = time.process_time()
        await work()
        times.append(time.process_time() - began)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=56)
    parser.add_argument("--words", type=int, default=600)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="seconds: 4 turns, 1 repeat")
    args = parser.parse_args()
    if args.smoke:
        args.turns, args.words, args.repeat = 4, 50, 1
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        view = weightless_view(prepare("qwen3-tiny"), Path(tmp))
        settings = parse_serve_args(
            [
                *("--model", str(view), "--served-model-name", "qwen3-tiny"),
                *("--reasoning-parser", "qwen3", "--max-model-len", "262144"),
                *("--max-request-bytes", str(256 * 2**20)),
                *("--session-store", str(Path(tmp) / "sessions.sqlite3")),
            ]
        )
        engine = FakeEngine.for_model(view, max_model_len=settings.max_model_len)
        with TestClient(create_app(settings, engine)) as client:
            while client.get("/health").status_code != 200:
                time.sleep(0.1)
            messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
            for _ in range(args.turns):
                messages.append({"role": "user", "content": text(rng, args.words)})
                messages.append({"role": "assistant", "content": text(rng, args.words)})
            render = {"messages": messages[:-1], "max_tokens": 8}
            prompt = client.post("/v1/chat/completions/render", json=render).json()["token_ids"]
            reply = messages[-1]["content"] + "<|im_end|>"
            tokenize = {"prompt": reply, "add_special_tokens": False}
            previous = prompt + client.post("/tokenize", json=tokenize).json()["tokens"]
            body = {
                "previous_token_ids": previous,
                "previous_messages": messages,
                "messages": [{"role": "user", "content": "Next?"}],
                "max_tokens": 8,
                "keep_history": True,
            }
            raw = orjson.dumps(body)
            headers = {"Content-Type": "application/json"}
            answer = client.post("/v1/chat/completions/extend", content=raw, headers=headers)
            answer = answer.json()
            if not answer.get("extended"):
                print(f"extend did not extend: {answer}")
                sys.exit(1)
            pipeline = client.app.state.pipeline  # type: ignore[attr-defined]
            runtime = pipeline.runtime

            async def stages() -> dict[str, float]:
                request = ExtendRequest.model_validate_json(raw)
                renders = await extend._renders(pipeline, runtime, request)
                boundary = extend.find_boundary(runtime, request, renders)
                full = renders.full
                return {
                    "body validation": best_ms(
                        args.repeat, lambda: ExtendRequest.model_validate_json(raw)
                    ),
                    "four template renders": await best_ms_async(
                        args.repeat, lambda: extend._renders(pipeline, runtime, request)
                    ),
                    "boundary (suffix encode)": best_ms(
                        args.repeat, lambda: extend.find_boundary(runtime, request, renders)
                    ),
                    "previous ids: vocabulary check": best_ms(
                        args.repeat, lambda: check_token_ids(runtime, previous, "ids")
                    ),
                    "previous ids: reply search": best_ms(
                        args.repeat,
                        lambda: extend.close_previous_turn(pipeline, runtime, previous, boundary),
                    ),
                    "extend, whole (after validation)": await best_ms_async(
                        args.repeat, lambda: extend.extend_chat(pipeline, request)
                    ),
                    "full re-encode (no keep_history)": best_ms(
                        args.repeat, lambda: runtime.tokenizer.encode(full)
                    ),
                }

            # On the app's own event loop (the pipeline's offload pools belong to it).
            results = client.portal.call(stages)  # type: ignore[union-attr]
    print(
        f"conversation: {len(messages)} messages, {len(previous):,} previous ids, "
        f"body {len(raw) / 1e6:.2f} MB; process CPU, best of {args.repeat}"
    )
    for stage, ms in results.items():
        print(f"  {stage:36s} {ms:8.2f} ms")
    total = results["body validation"] + results["extend, whole (after validation)"]
    print(f"extend with keep_history, body validation included: {total:.1f} ms (target <= 5 ms)")


if __name__ == "__main__":
    main()
