"""A long agent conversation's next prompt, over HTTP: render and extend as a stateless client
and as a trainer that keeps its ids (issue 33, items 1 and 2).

The real app on its uvicorn protocol over the project's fake engine (qwen3-tiny's tokenizer and
template, no weights), in its own process; a Qwen3 conversation of ``--turns`` user/assistant
pairs (``--words`` words each, some non-ASCII). Measured: the server's CPU per request (from
/proc, over ``--repeat`` requests each), for
- a cold render of a conversation the server has not seen (the baseline: one encode of the whole
  text), against the re-render of a conversation it rendered before with one new message (the
  pieces it encoded before are remembered);
- the extend of the last turn in full (previous ids and messages resent, ``keep_history``: the
  common RL case), against the same extend by reference (``previous_prompt``: the handle of the
  prompt the reply was sampled from, the sampled ids, the reply and the new message).
The re-render's ids are checked against transformers' own ``apply_chat_template`` and the
extends' against each other. Targets of the issue: re-render at most 16 ms, extend at most 5 ms.

Usage: ``python bench/bench_extend.py [--turns 56] [--words 600] [--repeat 20] [--smoke]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serverbench import ServerProcess, cpu_seconds, free_port, serve_fake_engine, tree_env

WORDS = ["the", "model", "returns", "a", "tool", "call", "with", "its", "arguments", "and"]
WORDS += ["then", "réponse", "数据", "ok"]
IM_END = 151645
EXTEND = "/v1/chat/completions/extend"
FLAGS = ("--reasoning-parser", "qwen3", "--max-model-len", "262144")
FLAGS += ("--max-request-bytes", str(256 * 2**20))


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversation(seed: int, turns: int, words: int) -> list[dict[str, Any]]:
    """System, then ``turns`` user/assistant pairs; ends with the last reply."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"Be brief ({seed})."}]
    for _ in range(turns):
        messages.append({"role": "user", "content": text(rng, words)})
        messages.append({"role": "assistant", "content": text(rng, words)})
    return messages


def serve(port: int) -> None:
    from tests.fake_engine import FakeEngine

    def make_engine(view: Path) -> FakeEngine:
        return FakeEngine.for_model(view, max_model_len=262144)

    serve_fake_engine(port, make_engine, *FLAGS, model="qwen3-tiny")


class Bench:
    def __init__(self, client: httpx.Client, pid: int, repeat: int) -> None:
        self.client, self.pid, self.repeat = client, pid, repeat

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post(path, content=orjson.dumps(body))
        response.raise_for_status()
        return response.json()

    def server_ms(
        self, path: str, bodies: Callable[[int], dict[str, Any]], times: int = 1
    ) -> float:
        """The server's CPU per request over ``times`` x ``repeat`` requests (bodies built
        beforehand)."""
        count = self.repeat * times
        raw = [orjson.dumps(bodies(index)) for index in range(count)]
        before = cpu_seconds(self.pid)
        for content in raw:
            self.client.post(path, content=content).raise_for_status()
        return (cpu_seconds(self.pid) - before) / count * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=56)
    parser.add_argument("--words", type=int, default=600)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="seconds: 4 turns, 2 repeats")
    args = parser.parse_args()
    if args.smoke:
        args.turns, args.words, args.repeat = 4, 50, 2
    port = free_port()
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, __file__, "--serve", str(port)]
    server = ServerProcess(command, port, env=tree_env(root))
    try:
        headers = {"Content-Type": "application/json"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=600) as client:
            results = run(Bench(client, server.process.pid, args.repeat), args)
    finally:
        server.stop()
    print(
        f"conversation: {results.pop('messages')} messages, {results.pop('tokens'):,} prompt "
        f"ids, full extend body {results.pop('full body MB'):.2f} MB; server CPU per request, "
        f"mean of {args.repeat} (extends: {5 * args.repeat})"
    )
    cold, warm = results["render, cold"], results["re-render, one new message"]
    full, reference = results["extend in full"], results["extend by reference"]
    for name, ms in results.items():
        print(f"  {name:36s} {ms:8.2f} ms")
    print(f"re-render vs cold render: {ratio(warm, cold)} (target <= 16 ms: {warm:.1f} ms)")
    print(f"extend by reference vs in full: {ratio(reference, full)} (target <= 5 ms)")


def ratio(value: float, baseline: float) -> str:
    # /proc counts CPU in clock ticks (10 ms): a smoke run's few requests may show none.
    return f"{value / baseline:.3f}x" if baseline else "n/a (under one clock tick)"


def run(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from tokenwire.assets import prepare

    hf = AutoTokenizer.from_pretrained(str(prepare("qwen3-tiny")))
    conversations = [conversation(seed, args.turns, args.words) for seed in range(args.repeat)]
    new = [{"role": "user", "content": "Next? réponse"}]

    def render_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
        return {"messages": messages, "max_tokens": 8, "return_prompt_handle": True}

    # Cold: conversations this server has not seen, without their last reply.
    cold = bench.server_ms(
        "/v1/chat/completions/render", lambda i: render_body(conversations[i][:-1])
    )
    # Warm: the same conversations, with their reply and one new message.
    warm = bench.server_ms(
        "/v1/chat/completions/render", lambda i: render_body([*conversations[i], *new])
    )
    messages = conversations[0]
    rendered = bench.post("/v1/chat/completions/render", render_body([*messages, *new]))
    # transformers' template (jinja2) and the whole text's encode: an independent oracle.
    text = hf.apply_chat_template([*messages, *new], add_generation_prompt=True, tokenize=False)
    if rendered["token_ids"] != hf.encode(text, add_special_tokens=False):
        sys.exit("the re-render's ids differ from transformers' apply_chat_template")

    # The last turn: its prompt (remembered), the reply's ids, one new message.
    first = bench.post("/v1/chat/completions/render", render_body(messages[:-1]))
    sampled = [*hf.encode(messages[-1]["content"], add_special_tokens=False), IM_END]
    options = {"messages": new, "max_tokens": 8, "keep_history": True}
    full_body = {
        "previous_token_ids": [*first["token_ids"], *sampled],
        "previous_messages": messages,
        **options,
    }
    reference_body = {
        "previous_prompt": first["prompt_handle"],
        "completion_token_ids": sampled,
        "reply": messages[-1],
        **options,
    }
    full_answer = bench.post("/v1/chat/completions/extend", full_body)
    reference_answer = bench.post("/v1/chat/completions/extend", reference_body)
    if not full_answer["extended"] or full_answer["token_ids"] != reference_answer["token_ids"]:
        sys.exit("extend by reference differs from extend in full")
    return {
        "messages": len(messages) + 1,
        "tokens": len(full_answer["token_ids"]),
        "full body MB": len(orjson.dumps(full_body)) / 1e6,
        "render, cold": cold,
        "re-render, one new message": warm,
        # Five times as many: these are a few ms each, and /proc counts 10 ms ticks.
        "extend in full": bench.server_ms(EXTEND, lambda _: full_body, times=5),
        "extend by reference": bench.server_ms(EXTEND, lambda _: reference_body, times=5),
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(int(sys.argv[2]))
    else:
        multiprocessing.set_start_method("spawn")
        main()
