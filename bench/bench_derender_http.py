"""Derender over HTTP against a JSON floor measured in the same run.

32,768 output ids of mixed code, CJK and emoji (qwen3-tiny) with the logprobs
/inference/v1/generate returns for them (none, top 0: the sampled token only, top 5), sent to
/v1/completions/derender and /v1/chat/completions/derender by one keep-alive client.

Floor, in this process with transformers loaded, start-up heap frozen and the collector off:
``orjson.loads`` of the request, ``tokenizer.decode`` of the ids, ``orjson.loads`` +
``orjson.dumps`` of the server's own response. Targets (DESIGN.md): round trip at most 1.2x /
1.5x / 2x the floor for none / top 0 / top 5. The CPU ratio (the server's CPU per request from
/proc against the floor's CPU) is shown too: other jobs on a shared machine move it less than
wall time. Streaming: the same ids through the streaming chat
derender in 64-token chunks (the client carries ``stream_state``), server CPU against the
one-shot chat derender; target at most 2x. Beside it, the floor of one HTTP call: the same
chunk bodies POSTed to a bare uvicorn ASGI app that parses each and echoes it back
(``bare_tokenize_app.py``). And /health latency (polled back to back by a second client) while
the server derenders the top-5 bodies, against an idle server.

Run: ``python bench/bench_derender_http.py [--repeat R] [--tokens N]``.
"""

from __future__ import annotations

import argparse
import gc
import http.client
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).parent))

from bench_derender import mixed_text, synthetic_logprobs
from serverbench import ServerProcess, cpu_seconds, free_port, tokenwire_command

from tokenwire.assets import prepare
from tokenwire.engine.base import TokenLogprob
from tokenwire.pipeline.logprobs import token_logprobs_json

# Logprobs asked of generate, and requests per repeat (/proc counts CPU in 10 ms ticks).
MODES = {"none": (None, 20), "top 0": (0, 2), "top 5": (5, 1)}
TARGETS = {"none": 1.2, "top 0": 1.5, "top 5": 2.0}
CHUNK = 64
COMPLETION = "/v1/completions/derender"
CHAT = "/v1/chat/completions/derender"


def generate_logprobs(ids: list[int], vocab_size: int, num_top: int) -> dict[str, Any]:
    """The ``logprobs`` object generate answers with (``token_id:N`` placeholders); an
    engine's alternatives are distinct ids, so every position has ``max(num_top, 1)``."""
    rng = random.Random(99)
    lps, top_ids, top_lps = synthetic_logprobs(ids, vocab_size, rng)
    entries = []
    for token_id, lp, row_ids, row_lps in zip(ids, lps, top_ids, top_lps, strict=True):
        row = list(dict.fromkeys(row_ids))
        while len(row) < len(row_lps):
            row.append(rng.randrange(vocab_size))
            row = list(dict.fromkeys(row))
        entries.append(TokenLogprob(token_id, lp, 1, tuple(zip(row, row_lps, strict=True))))
    return token_logprobs_json(entries, num_top)


def choice(ids: list[int], logprobs: dict[str, Any] | None, finish: str | None) -> dict:
    data: dict[str, Any] = {"index": 0, "token_ids": ids, "finish_reason": finish}
    if logprobs is not None:
        data["logprobs"] = logprobs
    return data


class Client:
    """One keep-alive connection; ``post`` returns (response bytes, wall seconds)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=600)

    def post(self, path: str, body: bytes) -> tuple[bytes, float]:
        try:
            return self._post(path, body)
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            self.connection.close()  # the server dropped an idle keep-alive connection
            return self._post(path, body)

    def _post(self, path: str, body: bytes) -> tuple[bytes, float]:
        started = time.perf_counter()
        self.connection.request("POST", path, body, {"Content-Type": "application/json"})
        response = self.connection.getresponse()
        data = response.read()
        wall = time.perf_counter() - started
        if response.status != 200:
            raise RuntimeError(f"{path}: {response.status} {data[:300]!r}")
        return data, wall


def timed(run: Callable[[], Any]) -> tuple[float, float]:
    """(wall, CPU) seconds of ``run()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def floor_seconds(
    request: bytes, ids: list[int], response: bytes, decode: Callable
) -> tuple[float, float]:
    """(wall, CPU) of the JSON floor of one derender, collector off (the strictest floor)."""
    gc.disable()
    try:
        parts = (
            timed(lambda: orjson.loads(request)),
            timed(lambda: decode(ids)),
            timed(lambda: orjson.dumps(orjson.loads(response))),
        )
    finally:
        gc.enable()
    return sum(part[0] for part in parts), sum(part[1] for part in parts)


@dataclass
class Samples:
    """Per repeat: round trip, server CPU per request, and the floor's wall and CPU."""

    round_trip: list[float] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)
    floor_cpu: list[float] = field(default_factory=list)
    response_bytes: int = 0


def measure(
    client: Client, pid: int, path: str, body: bytes, ids: list[int], decode: Callable, batch: int
) -> tuple[float, float, float, float, int]:
    """One repeat: ``batch`` requests (/proc counts CPU in 10 ms ticks), then the floor."""
    cpu = cpu_seconds(pid)
    walls = []
    for _ in range(batch):
        response, wall = client.post(path, body)
        walls.append(wall)
    server_cpu = (cpu_seconds(pid) - cpu) / batch
    floor_wall, floor_cpu = floor_seconds(body, ids, response, decode)
    return statistics.median(walls), server_cpu, floor_wall, floor_cpu, len(response)


def stream_bodies(
    ids: list[int], logprobs: dict[str, Any] | None
) -> list[tuple[dict[str, Any], bool]]:
    """The generate chunks of a streamed choice, ``CHUNK`` ids each."""
    chunks = []
    for start in range(0, len(ids), CHUNK):
        last = start + CHUNK >= len(ids)
        piece = None
        if logprobs is not None:
            piece = {"content": logprobs["content"][start : start + CHUNK]}
        chunk = choice(ids[start : start + CHUNK], piece, "length" if last else None)
        chunks.append(({"request_id": "bench", "choices": [chunk]}, last))
    return chunks


def run_stream(client: Client, chunks: list[tuple[dict[str, Any], bool]]) -> list[float]:
    """Feed every chunk, carrying the state; returns each call's wall seconds."""
    state = None
    walls = []
    for chunk, _ in chunks:
        body = orjson.dumps({"stream": True, "generate_chunk": chunk, "stream_state": state})
        data, wall = client.post(CHAT, body)
        walls.append(wall)
        state = orjson.loads(data)["stream_state"]
    return walls


def stream_floor(chunks: list[tuple[dict[str, Any], bool]], model_dir: Path, repeat: int) -> float:
    """Server CPU seconds of the chunk bodies POSTed to a bare uvicorn app that echoes them
    (median of ``repeat`` passes)."""
    port = free_port()
    app = str(Path(__file__).parent / "bare_tokenize_app.py")
    server = ServerProcess([sys.executable, app, str(model_dir), str(port), "raw"], port)
    try:
        client = Client(server.url)
        state = "x" * 600  # about the size of a real stream_state
        bodies = [
            orjson.dumps({"stream": True, "generate_chunk": chunk, "stream_state": state})
            for chunk, _ in chunks
        ]
        client.post("/echo", bodies[0])
        passes = []
        for _ in range(repeat):
            cpu = cpu_seconds(server.process.pid)
            for body in bodies:
                client.post("/echo", body)
            passes.append(cpu_seconds(server.process.pid) - cpu)
        return statistics.median(passes)
    finally:
        server.stop()


def health_latencies(url: str, work: list[tuple[str, bytes]]) -> list[float]:
    """Wall seconds of back-to-back GET /health while another client POSTs ``work`` (200 of
    them when there is none)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=600)
    busy = Client(url)
    thread = threading.Thread(target=lambda: [busy.post(path, body) for path, body in work])
    thread.start()
    latencies: list[float] = []
    while thread.is_alive() or (not work and len(latencies) < 200):
        started = time.perf_counter()
        connection.request("GET", "/health")
        connection.getresponse().read()
        latencies.append(time.perf_counter() - started)
    thread.join()
    connection.close()
    return latencies


def ratio(value: float, base: float) -> str:
    """``value / base``; a smoke run's CPU time can be below /proc's 10 ms tick (0)."""
    return f"{value / base:.2f}x" if base else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--stream-repeat", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.repeat, args.stream_repeat = 256, 1, 1

    from transformers import AutoTokenizer

    model_dir = prepare("qwen3-tiny")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = mixed_text(random.Random(1234), args.tokens * 5)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.tokens]
    n = len(ids)
    gc.collect()
    gc.freeze()  # as the server does after loading

    port = free_port()
    server = ServerProcess(
        tokenwire_command(port, "--model", "qwen3-tiny", "--max-model-len", str(n)), port
    )
    pid = server.process.pid
    client = Client(server.url)
    load = os.getloadavg()
    rows: dict[tuple[str, str], Samples] = {}
    sizes: dict[str, int] = {}
    stream_rows = []
    health: dict[str, list[float]] = {}
    try:
        health["idle"] = health_latencies(server.url, [])
        for mode, (num_top, batch) in MODES.items():
            logprobs = None if num_top is None else generate_logprobs(ids, len(tokenizer), num_top)
            response = {"request_id": "b", "choices": [choice(ids, logprobs, "length")]}
            bodies = {
                COMPLETION: orjson.dumps({"generate_responses": [response]}),
                CHAT: orjson.dumps({"generate_response": response}),
            }
            sizes[mode] = len(bodies[CHAT])
            for path, body in bodies.items():
                client.post(path, body)  # warm-up: JSON heads, caches
            for _ in range(args.repeat):
                for path, body in bodies.items():
                    samples = rows.setdefault((path, mode), Samples())
                    result = measure(client, pid, path, body, ids, tokenizer.decode, batch)
                    samples.round_trip.append(result[0])
                    samples.server_cpu.append(result[1])
                    samples.floor.append(result[2])
                    samples.floor_cpu.append(result[3])
                    samples.response_bytes = result[4]

            if mode == "top 5":
                work = [*bodies.items()] * 3
                health["during top-5 derenders"] = health_latencies(server.url, work)
            chunks = stream_bodies(ids, logprobs)
            one_cpu, stream_cpu, stream_wall = [], [], []
            for _ in range(args.stream_repeat):
                cpu = cpu_seconds(pid)
                for _ in range(4):
                    client.post(CHAT, bodies[CHAT])
                one_cpu.append((cpu_seconds(pid) - cpu) / 4)
                cpu = cpu_seconds(pid)
                stream_wall.append(sum(run_stream(client, chunks)))
                stream_cpu.append(cpu_seconds(pid) - cpu)
            stream_rows.append((mode, len(chunks), one_cpu, stream_cpu, stream_wall))
    finally:
        server.stop()
    http_floor = stream_floor(stream_bodies(ids, None), model_dir, args.stream_repeat)

    med = statistics.median
    print(
        f"qwen3-tiny, {n} output ids (mixed code/CJK/emoji), median of {args.repeat}; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n"
    )
    print(
        "| endpoint | logprobs | request / response MB | round trip ms | floor ms | ratio | "
        "server CPU ms | floor CPU ms | CPU ratio | target |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (path, mode), samples in rows.items():
        trip, floor = med(samples.round_trip), med(samples.floor)
        cpu, floor_cpu = med(samples.server_cpu), med(samples.floor_cpu)
        print(
            f"| {path} | {mode} | {sizes[mode] / 1e6:.1f} / {samples.response_bytes / 1e6:.1f} | "
            f"{trip * 1e3:.1f} | {floor * 1e3:.1f} | {ratio(trip, floor)} | {cpu * 1e3:.1f} | "
            f"{floor_cpu * 1e3:.1f} | {ratio(cpu, floor_cpu)} | <= {TARGETS[mode]}x |"
        )
    print(
        f"\nStreaming chat derender, {CHUNK}-token chunks, median of {args.stream_repeat} "
        "(server CPU from /proc; target: at most 2x one-shot)\n"
    )
    print("| logprobs | calls | one-shot CPU ms | streamed CPU ms | ratio | streamed wall ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode, calls, one_cpu, stream_cpu, stream_wall in stream_rows:
        print(
            f"| {mode} | {calls} | {med(one_cpu) * 1e3:.0f} | {med(stream_cpu) * 1e3:.0f} | "
            f"{ratio(med(stream_cpu), med(one_cpu))} | {med(stream_wall) * 1e3:.0f} |"
        )
    calls = len(stream_bodies(ids, None))
    print(
        f"\nFloor of one HTTP call (the chunk bodies echoed by a bare uvicorn ASGI app, no "
        f"logprobs): {http_floor * 1e3:.0f} ms of server CPU for {calls} calls, "
        f"{http_floor / calls * 1e6:.0f} µs per call\n"
    )
    print("| /health | requests | median ms | p99 ms | max ms |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, latencies in health.items():
        ordered = sorted(latencies)
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        print(
            f"| {label} | {len(ordered)} | {med(ordered) * 1e3:.1f} | {p99 * 1e3:.1f} | "
            f"{ordered[-1] * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
