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

``--tree OTHER_CHECKOUT`` serves another checkout beside this one (its own process) and measures
both extends on the two, alternated round by round (``--rounds``), with each round's ratio: on a
shared machine only same-run ratios compare.

``--fill N`` first sends each server N extends by reference: a server that has run a while
holds a full prompt memory (each turn it remembers evicts one), where a fresh one grows by
each turn it remembers, paying for the new pages (page faults, about 1 ms a 74K-token turn
here).

Usage: ``python bench/bench_extend.py [--turns 56] [--words 600] [--repeat 20] [--tree OTHER]
[--rounds 5] [--fill 300] [--smoke]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
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
NEW = [{"role": "user", "content": "Next? réponse"}]
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
    parser.add_argument("--tree", type=Path, help="another checkout, served beside (its extends)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds with --tree")
    parser.add_argument(
        "--fill",
        type=int,
        default=0,
        help="extends by reference on each server before the alternated rounds: 300 fill the "
        "default 1 GiB prompt memory, whose later turns evict (a long-running server)",
    )
    parser.add_argument("--smoke", action="store_true", help="seconds: 4 turns, 2 repeats")
    args = parser.parse_args()
    if args.smoke:
        args.turns, args.words, args.repeat, args.rounds = 4, 50, 2, 1
    root = Path(__file__).resolve().parents[1]
    trees = [root] if args.tree is None else [root, args.tree.resolve()]
    servers = []
    try:
        for tree in trees:
            port = free_port()
            command = [
                sys.executable,
                str(tree / "bench" / "bench_extend.py"),
                "--serve",
                str(port),
            ]
            servers.append(ServerProcess(command, port, env=tree_env(tree)))
        headers = {"Content-Type": "application/json"}
        clients = [httpx.Client(base_url=s.url, headers=headers, timeout=600) for s in servers]
        benches = [
            Bench(c, s.process.pid, args.repeat) for c, s in zip(clients, servers, strict=True)
        ]
        results = run(benches[0], args)
        if args.tree is not None:
            compared = compare(benches, trees, args)
    finally:
        for server in servers:
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
    if args.tree is not None:
        print(compared)


def compare(benches: list[Bench], trees: list[Path], args: argparse.Namespace) -> str:
    """Both extends on this tree's server and the other's, alternated round by round (which
    goes first alternates too); per round, this tree's CPU over the other's."""
    bodies = [extend_bodies(bench, args) for bench in benches]
    answers = [
        [b.post(EXTEND, body)["token_ids"] for body in pair]
        for b, pair in zip(benches, bodies, strict=True)
    ]
    if any(ids != answers[0][0] for pair in answers for ids in pair):
        sys.exit("the two trees' extends answer different ids")
    for bench, pair in zip(benches, bodies, strict=True):
        raw = orjson.dumps(pair[0])
        for _ in range(args.fill):
            bench.client.post(EXTEND, content=raw).raise_for_status()
    rounds: dict[str, list[tuple[float, float]]] = {"extend by reference": [], "extend in full": []}
    for index in range(args.rounds):
        for kind, name in enumerate(rounds):
            order = (0, 1) if index % 2 == 0 else (1, 0)
            ms = {
                i: benches[i].server_ms(EXTEND, lambda _, body=bodies[i][kind]: body, times=3)
                for i in order
            }
            rounds[name].append((ms[0], ms[1]))
    lines = [
        f"alternated with {trees[1]} ({args.rounds} rounds of {3 * args.repeat} extends, after "
        f"{args.fill} extends by reference on each; load "
        f"average {' '.join(f'{x:.1f}' for x in os.getloadavg())}):",
        "| request | this tree (median) | other tree (median) | this / other per round (median) |",
        "| --- | ---: | ---: | --- |",
    ]
    for name, pairs in rounds.items():
        ours, other = [p[0] for p in pairs], [p[1] for p in pairs]
        ratios = sorted(a / b for a, b in pairs if b)
        spread = (
            f"{ratios[0]:.2f}-{ratios[-1]:.2f} ({statistics.median(ratios):.2f}x)"
            if ratios
            else "n/a"
        )
        medians = f"{statistics.median(ours):.2f} ms | {statistics.median(other):.2f} ms"
        lines.append(f"| {name} | {medians} | {spread} |")
    return "\n".join(lines)


def ratio(value: float, baseline: float) -> str:
    # /proc counts CPU in clock ticks (10 ms): a smoke run's few requests may show none.
    return f"{value / baseline:.3f}x" if baseline else "n/a (under one clock tick)"


def run(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from tokenwire.assets import prepare

    hf = AutoTokenizer.from_pretrained(str(prepare("qwen3-tiny")))
    conversations = [conversation(seed, args.turns, args.words) for seed in range(args.repeat)]
    new = NEW

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

    reference_body, full_body = extend_bodies(bench, args)
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


def extend_bodies(bench: Bench, args: argparse.Namespace) -> tuple[dict[str, Any], ...]:
    """The last turn of conversation 0 by reference and in full: its prompt (rendered on
    ``bench``'s server, which remembers it), the reply's ids, one new message."""
    from transformers import AutoTokenizer

    from tokenwire.assets import prepare

    hf = AutoTokenizer.from_pretrained(str(prepare("qwen3-tiny")))
    messages = conversation(0, args.turns, args.words)
    body = {"messages": messages[:-1], "max_tokens": 8, "return_prompt_handle": True}
    first = bench.post("/v1/chat/completions/render", body)
    sampled = [*hf.encode(messages[-1]["content"], add_special_tokens=False), IM_END]
    options = {"messages": NEW, "max_tokens": 8, "keep_history": True}
    reference_body = {
        "previous_prompt": first["prompt_handle"],
        "completion_token_ids": sampled,
        "reply": messages[-1],
        **options,
    }
    full_body = {
        "previous_token_ids": [*first["token_ids"], *sampled],
        "previous_messages": messages,
        **options,
    }
    return reference_body, full_body


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(int(sys.argv[2]))
    else:
        multiprocessing.set_start_method("spawn")
        main()
