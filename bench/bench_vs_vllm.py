"""tokenwire on vLLM's engine against vLLM's own server, side by side, in one run (.venv-vllm).

Three servers on SmolLM2-135M (float32, eager), started one after the other so none shares the
cores with another:
- ``vllm``: vLLM's OpenAI server with its scale-out routes (``python -m
  vllm.entrypoints.openai.api_server --enable-scale-out``: /inference/v1/generate, /tokenize,
  render and derender);
- ``tw-vllm``: ``tokenwire serve --engine vllm``, the same engine under tokenwire's frontend;
- ``tw-hf``: ``tokenwire serve`` on its own hf engine, for the start time and tok/s baseline.

For each: start time (spawn to /health 200), req/s and frontend CPU per request (the server
process itself, from /proc; vLLM's engine core is a separate process in both vLLM servers) for a
small /tokenize, a chat render, an 8k-id derender with top-5 logprobs and short generates
(max_tokens 8) at 32 concurrent; decode tok/s at 1 and 32 concurrent requests; and derender
exactness on text whose characters split across byte-level tokens (U+FFFD pieces).

Then the frontends alone on the same engine (``vllm`` and ``tw-vllm``), in ``--rounds`` rounds
that alternate the servers (ABBA: the machine's drift falls on both): frontend CPU per
non-streamed request, short (max_tokens 8) and long-running (256 tokens, 32 concurrent); per
streamed token (32 concurrent streams); and with 1,024 non-streamed requests in flight on the
paused engine (``/pause?mode=keep``: vLLM's under ``VLLM_SERVER_DEV_MODE=1``, tokenwire's under
``--enable-rl-control``), as a share of one core over a quiet window. Both servers run with
those control routes on in every measure.
``--parity``: the hf and vllm engines in process, greedy ids and logprobs against a forward.

Usage: ``make bench-vllm`` (or ``VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1
.venv-vllm/bin/python bench/bench_vs_vllm.py [--quick]``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).parent))
from serverbench import (
    LoadResult,
    ServerProcess,
    cpu_seconds,
    free_port,
    run_load,
    tokenwire_command,
)

from tokenwire.assets import prepare

MODEL = "smollm2-135m-instruct"
ENGINE_FLAGS = ["--dtype", "float32", "--enforce-eager"]
CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
]
# Characters that byte-level BPE splits over several tokens, between plain words.
SPLIT_TEXT = "The dragon 龘 and the flamingo 🦩 melt 🫠 into naïve café prose. "
DERENDER_IDS = 8000
GENERATE = "/inference/v1/generate"
# The frontend measures run on these two: the same vLLM engine under each frontend.
FRONTENDS = ("vllm", "tw-vllm")


@dataclass(frozen=True)
class Sizes:
    """How much each frontend measure sends."""

    clients: int  # concurrent requests of the short, long and streamed loads
    short_requests: int  # non-streamed, max_tokens 8
    long_requests: int  # non-streamed, ``long_tokens`` each
    long_tokens: int
    streamed_requests: int  # ``long_tokens`` each
    in_flight: int  # non-streamed requests held on the paused engine
    window_s: float  # how long their frontend CPU is read


FULL = Sizes(32, 128, 32, 256, 32, 1024, 10.0)
QUICK = Sizes(32, 128, 32, 64, 32, 1024, 5.0)
SMOKE = Sizes(4, 8, 4, 8, 4, 16, 0.5)


def server_commands(model_dir: Path, port: int) -> dict[str, list[str]]:
    vllm = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        "--port",
        str(port),
        "--enable-scale-out",
        "--disable-log-stats",
        *ENGINE_FLAGS,
    ]
    return {
        "vllm": vllm,
        "tw-vllm": tokenwire_command(
            port, "--engine", "vllm", "--enable-rl-control", *ENGINE_FLAGS
        ),
        "tw-hf": tokenwire_command(port, "--dtype", "float32"),
    }


def start_server(command: list[str], port: int) -> ServerProcess:
    """vLLM's server with its /pause and /resume (dev mode), as tokenwire's has them."""
    return ServerProcess(command, port, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    response.raise_for_status()
    return response.json()


def derender_body(client: httpx.Client, prompt: list[int]) -> tuple[dict[str, Any], list[int]]:
    """A derender request for 8k output ids with top-5 logprobs, in the server's own shape: a real
    generate response (logprobs 5) whose choice is stretched to ``DERENDER_IDS`` entries."""
    ids = post(client, "/tokenize", {"model": MODEL, "prompt": SPLIT_TEXT * 400})["tokens"]
    ids = ids[:DERENDER_IDS]
    sampling = {"max_tokens": 2, "temperature": 0, "logprobs": 5, "ignore_eos": True}
    response = post(
        client, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": sampling}
    )
    choice = response["choices"][0]
    template = choice["logprobs"]["content"][0]

    def entry(token_id: int, rank: int) -> dict[str, Any]:
        item = {**template, "token": f"token_id:{token_id}", "logprob": -0.5 * rank}
        if "token_id" in item:
            item["token_id"] = token_id
        if "rank" in item:
            item["rank"] = rank
        item.pop("top_logprobs", None)
        return item

    content = [
        {
            **entry(t, 1),
            "top_logprobs": [entry(t, 1)] + [entry((t + j) % 49000, j + 1) for j in range(1, 5)],
        }
        for t in ids
    ]
    choice.update(token_ids=ids, finish_reason="length")
    choice["logprobs"] = {"content": content}
    return {"model": MODEL, "generate_response": response}, ids


def exactness(client: httpx.Client, prompt: list[int]) -> tuple[int, bool]:
    """U+FFFD pieces among the logprob tokens of a derendered split-character text, and whether
    the pieces join to the content."""
    body, _ = derender_body(client, prompt)
    ids = post(client, "/tokenize", {"model": MODEL, "prompt": SPLIT_TEXT * 4})["tokens"]
    choice = body["generate_response"]["choices"][0]
    choice["token_ids"] = ids
    choice["logprobs"]["content"] = choice["logprobs"]["content"][: len(ids)]
    for item, t in zip(choice["logprobs"]["content"], ids, strict=True):
        item["token"] = f"token_id:{t}"
        if "token_id" in item:
            item["token_id"] = t
    message = post(client, "/v1/chat/completions/derender", body)["choices"][0]
    pieces = [item["token"] for item in message["logprobs"]["content"]]
    print("split-character pieces:", [p for p in pieces if not p.isascii()][:8], file=sys.stderr)
    return sum("\ufffd" in p for p in pieces), "".join(pieces) == message["message"]["content"]


def decode_rate(url: str, prompt: list[int], concurrency: int, tokens: int) -> float:
    """Output tokens per second for ``concurrency`` greedy requests of ``tokens`` each."""

    async def main() -> float:
        sampling = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:

            async def one() -> int:
                body = {"token_ids": prompt, "sampling_params": sampling}
                response = await client.post("/inference/v1/generate", json=body)
                response.raise_for_status()
                return len(response.json()["choices"][0]["token_ids"])

            await one()  # warm up
            started = time.perf_counter()
            made = await asyncio.gather(*(one() for _ in range(concurrency)))
            return sum(made) / (time.perf_counter() - started)

    return asyncio.run(main())


def generate_body(prompt: list[int], tokens: int, seed: int, stream: bool = False) -> bytes:
    """A sampled generate of exactly ``tokens`` ids (eos ignored)."""
    sampling = {"max_tokens": tokens, "seed": seed, "ignore_eos": True}
    return orjson.dumps({"token_ids": prompt, "sampling_params": sampling, "stream": stream})


async def in_waves(clients: int, requests: int, one: Callable[[int], Awaitable[int]]) -> int:
    """``requests`` calls of ``one`` from ``clients`` concurrent workers; the sum of counts."""
    counter = iter(range(requests))
    counts: list[int] = []

    async def worker() -> None:
        for index in counter:
            counts.append(await one(index))

    await asyncio.gather(*(worker() for _ in range(clients)))
    return sum(counts)


async def non_streamed(client: httpx.AsyncClient, prompt: list[int], tokens: int, i: int) -> int:
    response = await client.post(GENERATE, content=generate_body(prompt, tokens, i))
    response.raise_for_status()
    made = len(response.json()["choices"][0]["token_ids"])
    assert made == tokens, f"{made} ids for max_tokens {tokens}"
    return 1


async def streamed(client: httpx.AsyncClient, prompt: list[int], tokens: int, i: int) -> int:
    """One streamed request; the ids it streamed."""
    made = 0
    body = generate_body(prompt, tokens, i, stream=True)
    async with client.stream("POST", GENERATE, content=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                made += sum(len(c["token_ids"]) for c in orjson.loads(line[6:])["choices"])
    assert made == tokens, f"{made} ids streamed for max_tokens {tokens}"
    return made


async def settle(pid: int, quiet_s: float = 0.02, limit_s: float = 60) -> None:
    """Wait until the server's CPU rests for two seconds in a row: what was sent has arrived
    and parked."""
    deadline = time.monotonic() + limit_s
    last, quiet = cpu_seconds(pid), 0
    while quiet < 2 and time.monotonic() < deadline:
        await asyncio.sleep(1)
        now = cpu_seconds(pid)
        quiet = quiet + 1 if now - last <= quiet_s else 0
        last = now


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def send_whole(url: httpx.URL, body: bytes) -> Connection:
    """POST ``body`` to the generate route on a connection of its own, written out in full
    before this returns (a client's pool cannot say when a request has left); the answer is
    left to read, and the connection open (a writer collected closes it: a disconnect)."""
    reader, writer = await asyncio.open_connection(url.host, url.port)
    head = f"POST {GENERATE} HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
    return reader, writer


async def finish_reason(connection: Connection) -> str:
    """The finish reason of a non-streamed answer read to the end of its connection."""
    reader, writer = connection
    answer = await reader.read()
    writer.close()
    head, _, content = answer.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0]
    assert b" 200 " in status, status
    return orjson.loads(content)["choices"][0]["finish_reason"]


async def held_in_flight(
    url: httpx.URL, pid: int, prompt: list[int], count: int, window_s: float
) -> float:
    """The share of one core the frontend spends while ``count`` non-streamed requests wait on
    the paused engine; then a pause that aborts them ends them all, and generation resumes."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as control:
        (await control.post("/pause", params={"mode": "keep"})).raise_for_status()
        try:
            held = [await send_whole(url, generate_body(prompt, 64, i)) for i in range(count)]
            await settle(pid)
            before = cpu_seconds(pid)
            await asyncio.sleep(window_s)
            share = (cpu_seconds(pid) - before) / window_s
            (await control.post("/pause", params={"mode": "abort"})).raise_for_status()
        finally:
            # Resumed before the answers are read: one that reached the engine after the
            # abort runs instead of waiting for a resume forever.
            (await control.post("/resume")).raise_for_status()
    reasons = [await finish_reason(connection) for connection in held]
    aborted = reasons.count("abort")
    assert aborted == count, f"{count - aborted} of {count} held requests were not in flight"
    return share


def frontend_cpu(url: str, pid: int, prompt: list[int], sizes: Sizes) -> dict[str, float]:
    """The frontend's CPU seconds (its own process) per non-streamed request, short and
    long-running, and per streamed token; and its share of a core with requests held."""
    Send = Callable[[httpx.AsyncClient, list[int], int, int], Awaitable[int]]
    loads: dict[str, tuple[Send, int, int]] = {
        "short": (non_streamed, 8, sizes.short_requests),
        "long": (non_streamed, sizes.long_tokens, sizes.long_requests),
        "token": (streamed, sizes.long_tokens, sizes.streamed_requests),
    }

    async def main() -> dict[str, float]:
        limits = httpx.Limits(
            max_connections=sizes.clients, max_keepalive_connections=sizes.clients
        )
        headers = {"Content-Type": "application/json"}
        async with httpx.AsyncClient(
            base_url=url, limits=limits, timeout=600, headers=headers
        ) as client:
            # Warm up the connections and the server's caches.
            await in_waves(sizes.clients, sizes.clients, partial(non_streamed, client, prompt, 2))
            result = {}
            for label, (send, tokens, requests) in loads.items():
                before = cpu_seconds(pid)
                count = await in_waves(
                    sizes.clients, requests, partial(send, client, prompt, tokens)
                )
                result[label] = (cpu_seconds(pid) - before) / count
            result["held"] = await held_in_flight(
                client.base_url, pid, prompt, sizes.in_flight, sizes.window_s
            )
            return result

    return asyncio.run(main())


def frontend_round(name: str, command: list[str], port: int, sizes: Sizes) -> dict[str, float]:
    """One more round of the frontend measures, on a fresh server."""
    server = start_server(command, port)
    try:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            prompt = post(client, "/tokenize", {"model": MODEL, "messages": CHAT})["tokens"]
        result = frontend_cpu(server.url, server.process.pid, prompt, sizes)
    finally:
        server.stop()
    print(f"{name} frontend: {result}", file=sys.stderr, flush=True)
    return result


def measure(
    name: str,
    command: list[str],
    port: int,
    quick: bool,
    decode_only: bool = False,
    sizes: Sizes | None = None,
) -> dict[str, Any]:
    """The server's start and loads; with ``sizes`` the frontend measures' first round too."""
    started = time.perf_counter()
    server = start_server(command, port)
    result: dict[str, Any] = {"start_s": time.perf_counter() - started}
    pid = server.process.pid
    scale = 4 if quick else 1
    try:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            prompt = post(client, "/tokenize", {"model": MODEL, "messages": CHAT})["tokens"]
            if not decode_only:
                derender = orjson.dumps(derender_body(client, prompt)[0])
                result["fffd"], result["joins"] = exactness(client, prompt)
        loads: dict[str, tuple[str, Callable[[int], bytes], int, int]] = {
            "tokenize": (
                "/tokenize",
                lambda i: orjson.dumps({"model": MODEL, "prompt": f"Hello world number {i}"}),
                32,
                2000 // scale,
            ),
            "render": (
                "/v1/chat/completions/render",
                lambda i: orjson.dumps({"model": MODEL, "messages": CHAT, "seed": i}),
                32,
                1000 // scale,
            ),
            "derender 8k top-5": (
                "/v1/chat/completions/derender",
                lambda i: derender,
                4,
                24 // scale,
            ),
            "generate 8 @32": (
                "/inference/v1/generate",
                lambda i: orjson.dumps(
                    {"token_ids": prompt, "sampling_params": {"max_tokens": 8, "seed": i}}
                ),
                32,
                128 // scale,
            ),
        }
        for label, (path, body, clients, requests) in loads.items():
            if decode_only:
                break
            result[label] = run_load(
                server.url, pid, path, body, clients=clients, requests=requests
            )
        tokens = 32 if quick else 64
        result["tok/s @1"] = decode_rate(server.url, prompt, 1, tokens)
        result["tok/s @32"] = decode_rate(server.url, prompt, 32, tokens)
        if sizes is not None:
            result["frontend"] = frontend_cpu(server.url, pid, prompt, sizes)
    finally:
        server.stop()
    plain = {k: (v.__dict__ if isinstance(v, LoadResult) else v) for k, v in result.items()}
    print(f"{name}: {plain}", file=sys.stderr, flush=True)  # kept if a later server fails
    return result


def report(results: dict[str, dict[str, Any]]) -> None:
    names = list(results)
    print("| measure | " + " | ".join(names) + " | tw-vllm / vllm |")
    print("| --- |" + " ---: |" * (len(names) + 1))
    print("| start (s) | " + " | ".join(f"{r['start_s']:.1f}" for r in results.values()) + " | |")
    for label in ("tokenize", "render", "derender 8k top-5", "generate 8 @32"):
        row = [results[n][label] for n in names]
        ratio = results["tw-vllm"][label].requests_per_s / results["vllm"][label].requests_per_s
        cells = [
            f"{r.requests_per_s:.1f} req/s, {r.cpu_us_per_request / 1000:.2f} ms CPU" for r in row
        ]
        print(f"| {label} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    for label in ("tok/s @1", "tok/s @32"):
        ratio = results["tw-vllm"][label] / results["vllm"][label]
        cells = [f"{results[n][label]:.1f}" for n in names]
        print(f"| {label} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    cells = [f"{results[n]['fffd']} U+FFFD, joins {results[n]['joins']}" for n in names]
    print("| derender exactness | " + " | ".join(cells) + " | |")


def report_frontends(rounds: dict[str, list[dict[str, float]]], sizes: Sizes) -> None:
    """Each frontend measure's mean over the rounds (each round's value in brackets)."""
    n, tokens = sizes.clients, sizes.long_tokens
    rows = [  # label, key, scale, unit
        (f"non-streamed, max_tokens 8, {n} concurrent: CPU per request", "short", 1e3, "ms"),
        (f"non-streamed, {tokens} tokens, {n} concurrent: CPU per request", "long", 1e3, "ms"),
        (f"streamed, {tokens} tokens, {n} concurrent: CPU per token", "token", 1e6, "µs"),
        (
            f"{sizes.in_flight} requests held on the paused engine: share of a core",
            "held",
            100,
            "%",
        ),
    ]
    print("| frontend process CPU | vllm | tw-vllm | tw-vllm / vllm |")
    print("| --- | ---: | ---: | ---: |")
    for label, key, scale, unit in rows:
        means = {}
        cells = []
        for name in FRONTENDS:
            values = [r[key] * scale for r in rounds[name]]
            means[name] = statistics.mean(values)
            each = ", ".join(f"{v:.2f}" for v in values)
            cells.append(f"{means[name]:.2f} {unit} ({each})")
        ratio = f"{means['tw-vllm'] / means['vllm']:.2f}x" if means["vllm"] else "-"
        print(f"| {label} | " + " | ".join(cells) + f" | {ratio} |")


def parity(model_dir: Path, prompts: int = 8, tokens: int = 32) -> None:
    """In process: greedy ids of the hf and vllm engines, and each one's logprobs (chosen and
    top 5) against one transformers forward over prompt + output (trainer parity)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenwire.engine.base import SamplingParams
    from tokenwire.engine.factory import create_engine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    topics = ["rain", "chess", "volcanoes", "tea", "jazz", "rivers", "owls", "glass"]
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Tell me about {topics[i % 8]}."}],
            add_generation_prompt=True,
            return_dict=True,
        )["input_ids"]
        for i in range(prompts)
    ]
    sampling = SamplingParams(max_tokens=tokens, temperature=0, logprobs=5, ignore_eos=True)

    async def run(kind: str) -> list[tuple[list[int], list[Any]]]:
        extra = ["--enforce-eager"] if kind == "vllm" else []
        engine = create_engine(
            kind, model_dir, max_model_len=None, max_num_seqs=16, dtype="float32", extra_args=extra
        )
        await engine.start()

        async def one(i: int, prompt: list[int]) -> tuple[list[int], list[Any]]:
            ids, lps = [], []
            async for out in engine.generate(f"p{i}", list(prompt), sampling):
                ids += out.new_token_ids
                lps += out.logprobs or []
            return ids, lps

        try:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(chats))))
        finally:
            await engine.shutdown()

    outputs = {kind: asyncio.run(run(kind)) for kind in ("hf", "vllm")}
    for kind, results in outputs.items():
        worst_chosen = worst_top = 0.0
        for prompt, (ids, lps) in zip(chats, results, strict=True):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([list(prompt) + ids[:-1]])).logits[0]
            ref = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1 :]
            for row, tl in zip(ref, lps, strict=True):
                worst_chosen = max(worst_chosen, abs(tl.logprob - float(row[tl.token_id])))
                for tid, lp in tl.top:
                    worst_top = max(worst_top, abs(lp - float(row[tid])))
        print(f"{kind}: max |logprob - forward| chosen {worst_chosen:.1e}, top-5 {worst_top:.1e}")
    same = [a[0] == b[0] for a, b in zip(outputs["hf"], outputs["vllm"], strict=True)]
    print(f"greedy ids equal hf vs vllm: {sum(same)}/{len(same)} prompts x {tokens} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and tokens")
    parser.add_argument("--only", nargs="+", help="a subset of: vllm tw-vllm tw-hf")
    parser.add_argument("--parity", action="store_true", help="only the engines' parity check")
    parser.add_argument("--decode-only", action="store_true", help="start time and tok/s only")
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds of the frontend measures (ABBA order)"
    )
    args = parser.parse_args()
    frontends = args.smoke or not args.decode_only
    sizes = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.smoke:
        args.quick, args.decode_only, args.rounds = True, True, 1
    model_dir = prepare(MODEL)
    if args.parity:
        parity(model_dir)
        return
    load_before = os.getloadavg()
    port = free_port()
    commands = server_commands(model_dir, port)
    results = {
        name: measure(
            name,
            command,
            port,
            args.quick,
            args.decode_only,
            sizes if frontends and name in FRONTENDS else None,
        )
        for name, command in commands.items()
        if not args.only or name in args.only
    }
    rounds = {name: [r["frontend"]] for name, r in results.items() if "frontend" in r}
    for index in range(1, args.rounds):  # the first round's order, then reversed, and so on
        for name in list(rounds)[:: -1 if index % 2 else 1]:
            rounds[name].append(frontend_round(name, commands[name], port, sizes))
    if {"vllm", "tw-vllm"} <= set(results) and not args.decode_only:
        report(results)
    if set(FRONTENDS) <= set(rounds):
        report_frontends(rounds, sizes)
    load = ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(load_before, os.getloadavg(), strict=True))
    print(f"load average (1, 5, 15 min) before/after: {load}")


if __name__ == "__main__":
    main()
