"""``--api-server-count N``: requests/s against N on the engine that costs nothing (issue 33,
item 4).

One tokenwire per N (N=1 is the one process ``tokenwire serve`` runs; N>1 is N frontends and
a core), each over ``cheap_engine.CheapEngine`` in its core, all started at once and loaded in
turn, round by round. The load is ``bench_small_request``'s raw HTTP/1.1 client, in this process
or split over ``--client-processes`` forked ones (one client process tops out near 20,000
requests/s, below what N frontends serve on many cores). The client shares the cores with the
server: on a machine of few cores its own CPU caps what any N can show
(``bench_process_ceiling`` measures that ceiling). Reported per N and
workload: requests/s by wall clock (median of the rounds, and its ratio to N=1 round by round)
and the server's CPU per request, summed over its processes from /proc.

Usage: ``python bench/bench_api_servers.py [--counts 1 2] [--rounds 3] [--requests 4000]
[--clients 32] [--client-processes 1] [--smoke]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from bench_small_request import load, workloads
from serverbench import ServerProcess, cpu_seconds_by_process, free_port, process_tree, tree_env

HERE = Path(__file__).resolve().parent


def serve(port: int, count: int) -> None:
    """Serve the default model's weightless view over the cheap engine with ``count`` API
    server processes; until killed."""
    from cheap_engine import CheapEngine

    from tests.fast_app import weightless_view
    from tokenwire.api.api_servers import serve_api_servers
    from tokenwire.api.app import create_app
    from tokenwire.api.server import GracefulServer, uvicorn_config
    from tokenwire.assets import prepare
    from tokenwire.settings import DEFAULT_MODEL, parse_serve_args

    with tempfile.TemporaryDirectory() as tmp:
        view = weightless_view(prepare(DEFAULT_MODEL), Path(tmp))
        argv = ["--model", str(view), "--port", str(port), "--log-level", "warning"]
        argv += ["--session-store", str(Path(tmp) / "sessions.sqlite3")]
        settings = parse_serve_args([*argv, "--api-server-count", str(count)])
        make_engine = functools.partial(CheapEngine.for_model, view)
        if count > 1:
            serve_api_servers(settings, make_engine)
            return
        app = create_app(settings, make_engine())
        GracefulServer(uvicorn_config(app, settings), app.state.pipeline, 5).run()


def core_of(pid: int) -> int | None:
    """The process listening on the job channel (None: one process serves everything)."""
    inodes = {
        line.split()[6]
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]
        if line.endswith("core-jobs.sock")
    }
    for child in process_tree(pid):
        for fd in Path(f"/proc/{child}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd).removeprefix("socket:[").rstrip("]") in inodes:
                    return child
    return None


def load_share(url: str, body: dict, requests: int, connections: int) -> None:
    """One client process's share of a load."""
    asyncio.run(load(url, body, requests, connections))


class Clients:
    """The load's client: this process, or ``count`` forked ones sharing each load evenly."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.pool = None
        if count > 1:
            self.pool = ProcessPoolExecutor(count, mp_context=get_context("fork"))

    def load(self, url: str, body: dict, requests: int, connections: int) -> None:
        if self.pool is None:
            load_share(url, body, requests, connections)
            return
        share = (requests // self.count, max(1, connections // self.count))
        futures = [self.pool.submit(load_share, url, body, *share) for _ in range(self.count)]
        for future in futures:
            future.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def measure(
    server: ServerProcess, body: dict, requests: int, connections: int, clients: Clients
) -> tuple[float, float, float]:
    """Requests/s by wall clock, and the server's CPU µs per request: all of it, and the
    core's share."""
    clients.load(server.url, body, connections * 4, connections)  # warm-up: caches
    core = core_of(server.process.pid)
    before, began = cpu_seconds_by_process(server.process.pid), time.perf_counter()
    clients.load(server.url, body, requests, connections)
    wall = time.perf_counter() - began
    after = cpu_seconds_by_process(server.process.pid)
    used = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
    core_us = 0.0 if core is None else used[core] / requests * 1e6
    return requests / wall, sum(used.values()) / requests * 1e6, core_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--clients", type=int, default=32, help="keep-alive connections")
    parser.add_argument("--client-processes", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.serve:
        serve(*args.serve)
        return
    if args.smoke:
        args.rounds, args.requests, args.clients = 1, 32, 4
    bodies = workloads(16)
    chosen = {name: bodies[name] for name in ("generate 16", "generate 16, logprobs 1")}
    servers = {}
    clients = Clients(args.client_processes)
    args.requests -= args.requests % args.client_processes  # an even share each
    try:
        for count in args.counts:
            port = free_port()
            command = [sys.executable, str(HERE / "bench_api_servers.py"), "--serve", str(port)]
            servers[count] = ServerProcess([*command, str(count)], port, env=tree_env(HERE.parent))
        results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
        for _ in range(args.rounds):
            for name, body in chosen.items():
                for count, server in servers.items():
                    result = measure(server, body, args.requests, args.clients, clients)
                    results.setdefault((name, count), []).append(result)
    finally:
        for server in servers.values():
            server.stop()
        clients.close()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end")
    for name in chosen:
        for count in args.counts:
            rounds = results[name, count]
            rates = [rate for rate, _, _ in rounds]
            cpu = statistics.median(us for _, us, _ in rounds)
            core = statistics.median(us for _, _, us in rounds)
            first = results[name, args.counts[0]]
            ratios = [rate / base[0] for rate, base in zip(rates, first, strict=True)]
            split = f" (the core {core:.0f})" if count > 1 else ""
            print(
                f"{name:23} N={count}: {statistics.median(rates):8.0f} requests/s "
                f"(x{statistics.median(ratios):.2f} of N={args.counts[0]}, rounds "
                f"{min(ratios):.2f}-{max(ratios):.2f}), server CPU {cpu:.0f} µs/request{split}"
            )


if __name__ == "__main__":
    main()
