"""The small-request path: server CPU of a short /inference/v1/generate against bare servers.

An RL loop sends many short requests; on an engine that costs nothing, what is left is the
frontend's own cost per request. Three servers answer the same three workloads, measured
interleaved in the same run (the machine is shared, so only same-run ratios hold):

- tokenwire: the real app on its uvicorn protocol over an engine that answers at once
  (``CheapEngine``: outputs made once at start-up; a non-streamed request gets one output, as
  vLLM's final-only mode gives, a streamed one an output per token, each in its own turn of
  the event loop as a real engine's tokens arrive);
- a bare FastAPI route (uvicorn, uvloop, httptools, orjson) that reads the body and returns the
  JSON tokenwire answered for it (captured from tokenwire first; streamed: the same chunks);
- a bare ASGI callable doing the same: the floor of one JSON call over HTTP.

Workloads: 16 output tokens without logprobs and with ``logprobs: 1`` (server CPU µs per
request), and a streamed 512-token generate (server CPU µs per token: the request's CPU over its
tokens). Server CPU is read from /proc around each load; the load generator shares the machine
but not the measured process. Issue 33's targets: a small generate at most 1.5x the bare FastAPI
route, logprobs included; streaming at most 20 µs per token. ``--tree`` serves another checkout's
tokenwire beside this one's (the before of a change). A failed request exits 1.

Usage: ``python bench/bench_small_request.py [--rounds 5] [--tree OTHER_CHECKOUT] [--smoke]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from serverbench import ServerProcess, cpu_seconds, free_port, serve_fake_engine, tree_env
from starlette.responses import Response, StreamingResponse

HERE = Path(__file__).resolve().parent
PROMPT = [1, 9690, 198, 504, 3575, 282, 4649, 314]
SMALL_TOKENS = 16
STREAM_TOKENS = 512  # at most cheap_engine.MOST_TOKENS
GENERATE = "/inference/v1/generate"


def workloads(stream_tokens: int) -> dict[str, dict[str, Any]]:
    """Name -> generate body."""
    small = {"max_tokens": SMALL_TOKENS, "ignore_eos": True}
    return {
        "generate 16": {"token_ids": PROMPT, "sampling_params": small},
        "generate 16, logprobs 1": {
            "token_ids": PROMPT,
            "sampling_params": {**small, "logprobs": 1},
        },
        f"streamed {stream_tokens}": {
            "token_ids": PROMPT,
            "stream": True,
            "sampling_params": {"max_tokens": stream_tokens, "ignore_eos": True},
        },
    }


# -- the servers ------------------------------------------------------------------------------


def serve_tokenwire(port: int) -> None:
    """The tokenwire on ``sys.path`` over an engine whose outputs cost next to nothing."""
    from cheap_engine import CheapEngine

    serve_fake_engine(port, CheapEngine.for_model)


def serve_bare(port: int, kind: str, answers_file: Path) -> None:
    """A bare server answering each workload's body with tokenwire's captured answer."""
    import uvicorn

    answers: dict[bytes, Any] = {
        orjson.dumps(body): answer for body, answer in orjson.loads(answers_file.read_bytes())
    }

    def frames(chunks: list[Any]) -> AsyncIterator[bytes]:
        async def each() -> AsyncIterator[bytes]:
            for chunk in chunks:
                await asyncio.sleep(0)  # as tokenwire's engine above: a turn per token
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return each()

    async def raw_app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        answer = answers[orjson.dumps(orjson.loads(body))]
        if isinstance(answer, list):
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for frame in frames(answer):
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        payload = orjson.dumps(answer)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    fastapi_app = FastAPI()

    @fastapi_app.get("/health")
    async def health() -> Response:
        return Response()

    @fastapi_app.post(GENERATE)
    async def generate(request: Request) -> Response:
        answer = answers[orjson.dumps(orjson.loads(await request.body()))]
        if isinstance(answer, list):
            return StreamingResponse(frames(answer), media_type="text/event-stream")
        return Response(orjson.dumps(answer), media_type="application/json")

    uvicorn.run(
        raw_app if kind == "raw" else fastapi_app,
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )


def start(*args: str, tree: Path = HERE.parent) -> ServerProcess:
    port = free_port()
    command = [sys.executable, str(HERE / "bench_small_request.py"), "--serve", str(port), *args]
    return ServerProcess(command, port, env=tree_env(tree))


# -- the load ---------------------------------------------------------------------------------


def capture(url: str, body: dict[str, Any]) -> Any:
    """tokenwire's answer to ``body``: its JSON, or a stream's chunks."""
    response = httpx.post(url + GENERATE, json=body, timeout=60)
    response.raise_for_status()
    if not body.get("stream"):
        return response.json()
    frames = response.text.split("\n\n")
    return [orjson.loads(frame[6:]) for frame in frames if frame.startswith("data: {")]


async def load(url: str, body: dict[str, Any], requests: int, clients: int) -> None:
    """``requests`` POSTs of ``body`` from ``clients`` keep-alive connections.

    A raw HTTP/1.1 client on asyncio streams, not httpx: the load must cost the shared cores
    little, so that the server is busy and handles requests several per wake-up, as under load;
    a slow client leaves it idle between requests, paying a wake-up each.
    """
    host, port = url.removeprefix("http://").split(":")
    payload = orjson.dumps(body)
    request = (
        f"POST {GENERATE} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    left = iter(range(requests))

    async def client() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for _ in left:
                writer.write(request)
                answer = await _response(reader)
                if body.get("stream") and (b'"error"' in answer or b"[DONE]" not in answer):
                    raise RuntimeError(f"the stream failed: {answer[-300:]!r}")
        finally:
            writer.close()

    await asyncio.gather(*(client() for _ in range(clients)))


async def _response(reader: asyncio.StreamReader) -> bytes:
    """One response's body (a 200's: anything else raises); chunked or by length."""
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200 "):
        raise RuntimeError(f"the server answered {head[:200]!r}")
    lines = head.lower().split(b"\r\n")
    for line in lines:
        if line.startswith(b"content-length:"):
            return await reader.readexactly(int(line[15:]))
    chunks = []
    while size := int(await reader.readuntil(b"\r\n"), 16):
        chunks.append(await reader.readexactly(size + 2))
    await reader.readuntil(b"\r\n")
    return b"".join(chunks)


def measure(server: ServerProcess, body: dict[str, Any], requests: int, clients: int) -> float:
    """Server CPU microseconds per request."""
    asyncio.run(load(server.url, body, clients, clients))  # warm-up: connections, caches
    before = cpu_seconds(server.process.pid)
    asyncio.run(load(server.url, body, requests, clients))
    return (cpu_seconds(server.process.pid) - before) / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000, help="small requests per load")
    parser.add_argument("--streams", type=int, default=40, help="streamed requests per load")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--tree", type=Path, help="another checkout's tokenwire, served beside")
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.serve:
        port, *rest = args.serve
        if rest:
            serve_bare(int(port), rest[0], Path(rest[1]))
        else:
            serve_tokenwire(int(port))
        return
    stream_tokens = STREAM_TOKENS
    if args.smoke:
        args.rounds, args.requests, args.streams, args.clients = 1, 16, 2, 4
        stream_tokens = 32
    runs = workloads(stream_tokens)
    servers = {"tokenwire": start()}
    if args.tree:
        servers["tokenwire --tree"] = start(tree=args.tree.resolve())
    try:
        answers = [(body, capture(servers["tokenwire"].url, body)) for body in runs.values()]
        with tempfile.NamedTemporaryFile(suffix=".json") as file:
            file.write(orjson.dumps(answers))
            file.flush()
            servers["bare FastAPI"] = start("fastapi", file.name)
            servers["bare ASGI"] = start("raw", file.name)
        results: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for workload, body in runs.items():
                streamed = bool(body.get("stream"))
                for name, server in servers.items():
                    if streamed:
                        cost = measure(server, body, args.streams, min(args.clients, 8))
                        cost /= stream_tokens
                    else:
                        cost = measure(server, body, args.requests, args.clients)
                    results.setdefault((workload, name), []).append(cost)
    finally:
        for server in servers.values():
            server.stop()
    report(runs, list(servers), results, args.rounds)


def report(
    runs: dict[str, dict[str, Any]],
    names: list[str],
    results: dict[tuple[str, str], list[float]],
    rounds: int,
) -> None:
    """Per workload and server: each round's CPU, the median, and the same-round ratios to the
    bare FastAPI route."""
    print(
        f"server CPU per request (streamed: per token), µs; {rounds} rounds, interleaved "
        f"(load average {os.getloadavg()[0]:.1f})\n"
    )
    print("| workload | server | rounds | median | / bare FastAPI (per round) | median ratio |")
    print("| --- | --- | --- | ---: | --- | ---: |")
    for workload in runs:
        bare = results[workload, "bare FastAPI"]
        for name in names:
            costs = results[workload, name]
            # A smoke run's loads may read 0 ticks (10 ms) of CPU.
            ratios = [c / b if b else float("nan") for c, b in zip(costs, bare, strict=True)]
            print(
                f"| {workload} | {name} | {', '.join(f'{c:.1f}' for c in costs)} | "
                f"{statistics.median(costs):.1f} | {', '.join(f'{r:.2f}' for r in ratios)} | "
                f"{statistics.median(ratios):.2f}x |"
            )


if __name__ == "__main__":
    main()
