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
``--parity``: the hf and vllm engines in process, greedy ids and logprobs against a forward.

Usage: ``make bench-vllm`` (or ``VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1
.venv-vllm/bin/python bench/bench_vs_vllm.py [--quick]``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).parent))
from serverbench import LoadResult, ServerProcess, free_port, run_load, tokenwire_command

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
        "tw-vllm": tokenwire_command(port, "--engine", "vllm", *ENGINE_FLAGS),
        "tw-hf": tokenwire_command(port, "--dtype", "float32"),
    }


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


def measure(
    name: str, command: list[str], port: int, quick: bool, decode_only: bool = False
) -> dict[str, Any]:
    started = time.perf_counter()
    server = ServerProcess(command, port)
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
    args = parser.parse_args()
    if args.smoke:
        args.quick, args.decode_only = True, True
    model_dir = prepare(MODEL)
    if args.parity:
        parity(model_dir)
        return
    port = free_port()
    commands = server_commands(model_dir, port)
    results = {
        name: measure(name, command, port, args.quick, args.decode_only)
        for name, command in commands.items()
        if not args.only or name in args.only
    }
    if {"vllm", "tw-vllm"} <= set(results) and not args.decode_only:
        report(results)


if __name__ == "__main__":
    main()
