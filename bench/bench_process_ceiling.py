"""What a second frontend process could give on this machine (issue 33 item 4's acceptance:
``--api-server-count 2`` at least 1.6x the requests/s of one process on the engine that costs
nothing), measured before anything is built.

Two whole tokenwire processes, each with its own engine that costs nothing
(``bench_small_request``'s), stand in for two frontends over one engine: they share nothing,
so no IPC or shared state costs anything, and their requests/s is a ceiling that the real
thing can only approach. The load is ``bench_small_request``'s raw client, in this process.
Per round, by wall clock: one server taking all the load, then the two taking half each. Also
measured: the CPU per request of the client (this process) and of a server (from /proc).
The arithmetic ceiling on ``os.cpu_count()`` cores is then
``min(cores / (server + client), 2 / server)`` against ``min(cores / (server + client),
1 / server)`` requests per second.

Usage: ``python bench/bench_process_ceiling.py [--rounds 3] [--requests 4000] [--smoke]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from bench_small_request import load, start, workloads
from serverbench import cpu_seconds


def rate(urls: list[str], body: dict, requests: int, clients: int) -> float:
    """Requests/s by wall clock, ``requests`` split evenly over ``urls``' servers."""

    async def run(count: int) -> None:
        per_server, per_clients = count // len(urls), max(clients // len(urls), 1)
        await asyncio.gather(*(load(url, body, per_server, per_clients) for url in urls))

    asyncio.run(run(clients))  # warm-up: connections, caches
    began = time.perf_counter()
    asyncio.run(run(requests))
    return requests / (time.perf_counter() - began)


def costs(url: str, pid: int, body: dict, requests: int, clients: int) -> tuple[float, float]:
    """CPU µs per request: the client's (this process) and the server's."""
    client, server = time.process_time(), cpu_seconds(pid)
    asyncio.run(load(url, body, requests, clients))
    client, server = time.process_time() - client, cpu_seconds(pid) - server
    return client / requests * 1e6, server / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.requests, args.clients = 1, 32, 4
    body = workloads(16)["generate 16"]
    first = start()
    # A smoke run checks that the bench runs: one server taking both halves is enough there.
    second = first if args.smoke else start()
    rows = []
    try:
        for _ in range(args.rounds):
            client, server = costs(first.url, first.process.pid, body, args.requests, args.clients)
            one = rate([first.url], body, args.requests, args.clients)
            two = rate([first.url, second.url], body, args.requests, args.clients)
            rows.append((client, server, one, two))
    finally:
        for server in {first, second}:
            server.stop()
    cores = os.cpu_count() or 1
    print(f"{cores} cores, load average {os.getloadavg()[0]:.1f}, generate 16 tokens\n")
    print(
        "| round | client µs/req | server µs/req | one server req/s | two servers req/s | ratio |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, (client, server, one, two) in enumerate(rows):
        print(f"| {i} | {client:.0f} | {server:.0f} | {one:.0f} | {two:.0f} | {two / one:.2f}x |")
    client = statistics.median(r[0] for r in rows)
    server = statistics.median(r[1] for r in rows)
    if client and server:  # a smoke run's loads may read 0 ticks (10 ms) of CPU
        per_core = cores / (server + client)  # requests/s if every core served and loaded
        ceiling = min(per_core, 2 / server) / min(per_core, 1 / server)
        print(f"\narithmetic ceiling of two processes here: {ceiling:.2f}x one")


if __name__ == "__main__":
    main()
