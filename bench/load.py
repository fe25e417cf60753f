"""Bounded load test: many clients, every kind of request, drops and aborts, and poisons.

Starts its own server (the embedded SmolLM2 on 127.0.0.1), warms it with the same mix, then for
``--duration`` seconds ``--clients`` clients each loop over: tokenize, render, derender,
generate (whole and streamed; a quarter of the streams hang up at a random point), and generate
aborted by id mid-way. Half-way through, the poison requests are sent (sampling values that
overflow float32, and the most extreme ones the server accepts); each may fail, nothing else may.

Prints statuses and latency percentiles per kind, the poisons' answers, the server's RSS before
and after (summed over its processes) and the engine slots still in use after. Exits 1 if any
request but the poisons got a 5xx or a failed stream, a request that was not aborted ended
"abort", a slot is left, or RSS (less the prefix cache, sized by its flag) is not back within
10% of the warm start.

Usage: ``python bench/load.py [--clients 128] [--duration 120] [--warmup 10] [--rounds 1]
[--api-server-count 1]``
(with more rounds, RSS after each tells a working set that settles from a leak that grows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serverbench import (
    ServerProcess,
    cpu_seconds_by_process,
    free_port,
    process_tree,
    tokenwire_command,
)

# Issue 9 item 1: a penalty that is 0 in float32 made inf logits and top-k's candidate draw
# failed, with the whole prefill group or running batch (1e308 does not trip it on every prompt;
# 1e-45 did); now refused at validation. The second is the most extreme the server accepts
# (penalty and temperature at their bounds, top_p the smallest double), so it reaches the engine.
POISONS = [
    {"repetition_penalty": 1e-45, "top_k": 5, "temperature": 1.0, "max_tokens": 8},
    {"repetition_penalty": 1e-4, "temperature": 1e-4, "top_p": 5e-324, "top_k": 5, "max_tokens": 8},
]
STREAM_DROP_SHARE = 0.25
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three prime numbers.",
    "Why is the sky blue? Answer in one sentence.",
    "Translate 'good morning' into Spanish.",
]
# Kinds of request and their shares of the mix.
MIX = {
    "tokenize": 3,
    "render": 2,
    "derender": 2,
    "generate": 3,
    "generate_stream": 3,
    "generate_abort": 1,
}


@dataclass
class Outcome:
    kind: str
    status: int
    seconds: float
    problem: str | None = None  # an innocent request that did not end as it should


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    poisons: list[str] = field(default_factory=list)

    def add(self, kind: str, status: int, started: float, problem: str | None = None) -> None:
        self.outcomes.append(Outcome(kind, status, time.perf_counter() - started, problem))


class Client:
    def __init__(self, http: httpx.AsyncClient, prompts: list[list[int]], run: Run) -> None:
        self.http = http
        self.prompts = prompts
        self.run = run

    async def one(self, kind: str) -> None:
        started = time.perf_counter()
        try:
            await getattr(self, kind)(started)
        except httpx.HTTPError as exc:
            self.run.add(kind, 0, started, f"transport error: {type(exc).__name__}: {exc}")

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": random.choice(QUESTIONS)}]

    def sampling(self) -> dict:
        return {"max_tokens": random.randint(4, 16), "temperature": random.choice([0.0, 0.8])}

    async def tokenize(self, started: float) -> None:
        body = random.choice([{"messages": self.messages()}, {"prompt": random.choice(QUESTIONS)}])
        response = await self.http.post("/tokenize", json=body)
        self.run.add("tokenize", response.status_code, started, _unexpected(response))

    async def render(self, started: float) -> None:
        body = {"messages": self.messages(), "max_tokens": 8}
        response = await self.http.post("/v1/chat/completions/render", json=body)
        self.run.add("render", response.status_code, started, _unexpected(response))

    async def derender(self, started: float) -> None:
        ids = random.choice(self.prompts)[-12:]
        generated = {"request_id": "d", "choices": [{"index": 0, "token_ids": ids}]}
        body = {"generate_response": generated, "prompt_tokens": 3}
        response = await self.http.post("/v1/chat/completions/derender", json=body)
        self.run.add("derender", response.status_code, started, _unexpected(response))

    async def generate(self, started: float) -> None:
        body = {"token_ids": random.choice(self.prompts), "sampling_params": self.sampling()}
        response = await self.http.post("/inference/v1/generate", json=body)
        problem = _unexpected(response)
        if problem is None and _finish(response) not in ("length", "stop"):
            problem = f"finish_reason {_finish(response)!r} without an abort"
        self.run.add("generate", response.status_code, started, problem)

    async def generate_stream(self, started: float) -> None:
        body = {
            "token_ids": random.choice(self.prompts),
            "sampling_params": self.sampling(),
            "stream": True,
        }
        drop_after = random.randint(0, 4) if random.random() < STREAM_DROP_SHARE else None
        kind = "generate_stream" if drop_after is None else "generate_stream_drop"
        events: list[str] = []
        async with self.http.stream("POST", "/inference/v1/generate", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                self.run.add(kind, response.status_code, started, _unexpected(response))
                return
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if drop_after is not None and len(events) > drop_after:
                        break  # leaving the block closes the connection mid-stream
        self.run.add(
            kind, 200, started, None if drop_after is not None else _stream_problem(events)
        )

    async def generate_abort(self, started: float) -> None:
        request_id = f"load-abort-{uuid.uuid4().hex}"
        body = {
            "token_ids": random.choice(self.prompts),
            "sampling_params": {"max_tokens": 64, "temperature": 0.8},
            "request_id": request_id,
        }
        pending = asyncio.create_task(self.http.post("/inference/v1/generate", json=body))
        await asyncio.sleep(random.uniform(0.05, 2.0))
        abort = await self.http.post("/abort_requests", json={"request_ids": [request_id]})
        self.run.add("abort_requests", abort.status_code, started, _unexpected(abort))
        response = await pending
        problem = _unexpected(response)
        if problem is None and _finish(response) not in ("abort", "length", "stop"):
            problem = f"finish_reason {_finish(response)!r}"
        self.run.add("generate_abort", response.status_code, started, problem)


def _unexpected(response: httpx.Response) -> str | None:
    if response.status_code == 200:
        return None
    return f"{response.status_code}: {response.text[:200]}"


def _finish(response: httpx.Response) -> str | None:
    return response.json()["choices"][0]["finish_reason"]


def _stream_problem(events: list[str]) -> str | None:
    """A whole stream ends with [DONE], has no error event, and its choice finished normally."""
    if not events or events[-1] != "[DONE]":
        return "stream did not end with [DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    errors = [chunk["error"] for chunk in chunks if "error" in chunk]
    if errors:
        return f"error event: {errors[0]}"
    finishes = [c["finish_reason"] for chunk in chunks for c in chunk["choices"]]
    if not finishes or finishes[-1] not in ("length", "stop"):
        return f"stream ended with finish_reason {finishes[-1:]}"
    return None


async def drive(url: str, clients: int, seconds: float, prompts: list, poison: bool) -> Run:
    run = Run()
    kinds = [kind for kind, share in MIX.items() for _ in range(share)]
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300) as http:
        client = Client(http, prompts, run)
        deadline = time.monotonic() + seconds

        async def loop() -> None:
            while time.monotonic() < deadline:
                await client.one(random.choice(kinds))

        async def send_poison(sampling: dict) -> None:
            await asyncio.sleep(seconds / 2)
            body = {"token_ids": prompts[0], "sampling_params": sampling}
            response = await http.post("/inference/v1/generate", json=body)
            run.poisons.append(f"{sampling}: {response.status_code} {response.text[:160]}")

        await asyncio.gather(
            *(loop() for _ in range(clients)),
            *(send_poison(sampling) for sampling in (POISONS if poison else [])),
        )
    return run


def rss_mib(pid: int) -> float:
    """Resident memory of the server: of every process it runs (``--api-server-count``)."""
    return sum(_own_rss_mib(process) for process in process_tree(pid))


def _own_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def server_cpu_seconds(pid: int) -> float:
    """CPU of every process the server runs (``--api-server-count``)."""
    return sum(cpu_seconds_by_process(pid).values())


def engine_gauges(url: str) -> dict[str, float]:
    """The ``tokenwire_engine_*`` gauges of /metrics, by their short name."""
    gauges = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("tokenwire_engine_"):
            name, value = line.split()
            gauges[name.removeprefix("tokenwire_engine_")] = float(value)
    return gauges


def prefix_cache_mib(url: str) -> float:
    """KV the hf engine's prefix cache holds (0 where the engine reports none)."""
    return engine_gauges(url).get("prefix_cache_bytes", 0.0) / 2**20


def settle(url: str, timeout_s: float = 60) -> int:
    """Wait until no request is in the engine and an idle engine has freed its batch's KV
    buffers (so RSS readings compare like with like); the slots still in use."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        gauges = engine_gauges(url)
        slots = int(gauges["running_requests"] + gauges["waiting_requests"])
        if not slots and not gauges.get("kv_cache_bytes", 0):
            break
        time.sleep(0.5)
    return slots


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def report(run: Run, seconds: float) -> list[str]:
    by_kind: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in run.outcomes:
        by_kind[outcome.kind].append(outcome)
    print(
        f"\n{len(run.outcomes)} requests in {seconds:.0f} s ({len(run.outcomes) / seconds:.1f}/s)"
    )
    print(f"{'kind':22} {'n':>6}  {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} {'max s':>7}  statuses")
    for kind, outcomes in sorted(by_kind.items()):
        times = [o.seconds for o in outcomes]
        statuses = dict(sorted(Counter(o.status for o in outcomes).items()))
        print(
            f"{kind:22} {len(outcomes):6d}  {pct(times, 50):7.2f} {pct(times, 90):7.2f} "
            f"{pct(times, 99):7.2f} {max(times):7.2f}  {statuses}"
        )
    return [f"{o.kind}: {o.problem}" for o in run.outcomes if o.problem]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--duration", type=float, default=120, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=10, help="seconds of the same mix first")
    parser.add_argument("--rounds", type=int, default=1, help="load rounds (RSS after each)")
    parser.add_argument("--no-poison", action="store_true")
    parser.add_argument("--log", type=Path, default=Path("/tmp/tokenwire-load-server.log"))
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    parser.add_argument(
        "--api-server-count", type=int, default=1, help="frontend processes (a core beside)"
    )
    args = parser.parse_args()
    if args.smoke:
        args.clients, args.duration, args.warmup = 4, 3.0, 1.0

    port = free_port()
    command = tokenwire_command(port, "--api-server-count", str(args.api_server_count))
    server = ServerProcess(command, port, log=args.log)
    url = server.url
    try:
        pid = server.process.pid
        load_before = os.getloadavg()
        rss_idle = rss_mib(pid)
        prompts = [
            httpx.post(
                f"{url}/tokenize", json={"messages": [{"role": "user", "content": q}]}
            ).json()["tokens"]
            for q in QUESTIONS
        ]
        asyncio.run(drive(url, args.clients, args.warmup, prompts, poison=False))
        settle(url)
        rss = [rss_mib(pid)]
        cached = [prefix_cache_mib(url)]
        print(f"server pid {pid}; {args.clients} clients for {args.duration:.0f} s on {url}")
        problems: list[str] = []
        for round_index in range(args.rounds):
            started, cpu_before = time.perf_counter(), server_cpu_seconds(pid)
            tokens_before = engine_gauges(url)["tokens_generated"]
            poison = not args.no_poison and round_index == 0
            run = asyncio.run(drive(url, args.clients, args.duration, prompts, poison))
            elapsed = time.perf_counter() - started
            server_cpu = server_cpu_seconds(pid) - cpu_before
            tokens = engine_gauges(url)["tokens_generated"] - tokens_before
            slots = settle(url)
            rss.append(rss_mib(pid))
            cached.append(prefix_cache_mib(url))
            problems += report(run, elapsed)
            print(
                f"server CPU {server_cpu:.0f} s in {elapsed:.0f} s; {tokens:.0f} tokens "
                f"generated ({tokens / elapsed:.1f}/s); engine slots in use after: {slots}; "
                f"RSS after {rss[-1]:.0f} MiB, of which prefix cache {cached[-1]:.0f} MiB"
            )
            if slots:
                problems.append(f"round {round_index + 1}: {slots} engine slots still in use")
            for line in run.poisons:
                print("poison", line)
        load_after = os.getloadavg()
    finally:
        server.stop()

    # The prefix cache is memory the operator sized (--prefix-cache-bytes), kept on purpose:
    # the check is on the rest.
    rss_after, rss_before = rss[-1] - cached[-1], rss[0] - cached[0]
    print(
        f"\nRSS MiB: idle {rss_idle:.0f}, warm (before) {rss[0]:.0f}, after each round "
        f"{', '.join(f'{value:.0f}' for value in rss[1:])}; prefix cache "
        f"{', '.join(f'{value:.0f}' for value in cached)}; without it {rss_before:.0f} -> "
        f"{rss_after:.0f} ({(rss_after / rss_before - 1) * 100:+.1f}%)"
    )
    cpus = os.cpu_count()
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} ({cpus} CPUs)")
    failures = list(problems)
    if rss_after > rss_before * 1.10:
        failures.append("RSS not back within 10% of the warm start")
    for failure in failures[:20]:
        print("FAIL", failure)
    if len(failures) > 20:
        print(f"... and {len(failures) - 20} more")
    print("PASS" if not failures else f"FAILED: {len(failures)} problems (server log: {args.log})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
