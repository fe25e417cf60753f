"""Amplifying request chat templates against innocent requests (issue 9, item 5).

Starts a qwen3-tiny server with ``--trust-request-chat-template``, sends ``--bad`` concurrent
``/tokenize`` requests whose template amplifies strings (``|replace`` or the ``.replace()``
method, ten times 100 MB each; ``~`` on a 50 MB string a hundred times), and meanwhile polls
``/health`` and an innocent ``/tokenize`` back to back. Prints the bad requests' statuses, the
innocent requests' worst latency, the server's CPU seconds and its peak RSS above the start
(template worker processes, if any, are sampled every poll and reported apart), then what
``indent(400000000)`` answers (on the code before issue 9 that request made the tokenizer take
the machine's memory: run it under ``ulimit -v``).

    .venv/bin/python bench/bench_request_templates.py [--bad 8] [--kinds ...] [-- --flag ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_media_limits import rss_kib
from serverbench import ServerProcess, cpu_seconds, free_port, tokenwire_command

AMPLIFY = {
    "filter": '{% for i in range(10) %}{{ ("x" * 1000)|replace("x", "y" * 100000)|length }}'
    "{% endfor %}",
    "method": '{% for i in range(10) %}{{ ("x" * 1000).replace("x", "y" * 100000)|length }}'
    "{% endfor %}",
    "concat": '{% set s = "x" * 50000000 %}{% for i in range(100) %}{% set t = s ~ "a" %}'
    "{% endfor %}{{ 1 }}",
}
INDENT = '{{ "a\\nb"|indent(400000000) }}'
MESSAGES = [{"role": "user", "content": "hi"}]


def children_rss_kib(pid: int) -> int:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(FileNotFoundError, KeyError, ProcessLookupError):
                total += rss_kib(int(child), "VmRSS")
    return total


async def run(url: str, pid: int, template: str, bad: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        innocent = {"messages": MESSAGES}
        assert (await client.post("/tokenize", json=innocent)).status_code == 200
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        rss_before = rss_kib(pid, "VmRSS")
        cpu_before = cpu_seconds(pid)
        body = {"messages": MESSAGES, "chat_template": template}
        started = time.perf_counter()
        bad_tasks = [asyncio.create_task(client.post("/tokenize", json=body)) for _ in range(bad)]
        worst: dict[str, float] = {"/health": 0.0, "/tokenize": 0.0}
        workers_peak = 0
        while not all(task.done() for task in bad_tasks):
            for path in worst:
                t0 = time.perf_counter()
                if path == "/health":
                    response = await client.get(path)
                else:
                    response = await client.post(path, json=innocent)
                assert response.status_code == 200, response.text
                worst[path] = max(worst[path], time.perf_counter() - t0)
            workers_peak = max(workers_peak, children_rss_kib(pid))
            await asyncio.sleep(0.05)
        wall = time.perf_counter() - started
        statuses = Counter(task.result().status_code for task in bad_tasks)
        first = bad_tasks[0].result().json()
        cpu = cpu_seconds(pid) - cpu_before
        peak = rss_kib(pid, "VmHWM") - rss_before
        print(f"  {bad} bad requests: statuses {dict(statuses)} in {wall:.2f} s")
        print(f"  first answer: {str(first)[:150]}")
        print(
            f"  worst innocent latency: /health {worst['/health']:.3f} s, "
            f"/tokenize {worst['/tokenize']:.3f} s"
        )
        print(
            f"  server CPU {cpu:.2f} s, server peak RSS +{peak / 1024:.0f} MiB, "
            f"template workers RSS peak (sampled) {workers_peak / 1024:.0f} MiB"
        )


async def indent(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        started = time.perf_counter()
        response = await client.post(
            "/tokenize", json={"messages": MESSAGES, "chat_template": INDENT}
        )
        wall = time.perf_counter() - started
        print(f"  indent(400000000): {response.status_code} in {wall:.2f} s: {response.text[:150]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bad", type=int, default=8)
    parser.add_argument("--kinds", nargs="+", default=list(AMPLIFY), choices=list(AMPLIFY))
    parser.add_argument("--no-indent", action="store_true", help="skip indent(400000000)")
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args, server_args = parser.parse_known_args()
    if args.smoke:
        args.bad, args.kinds, args.no_indent = 1, list(AMPLIFY)[:1], True
    server_args = [a for a in server_args if a != "--"]
    port = free_port()
    command = tokenwire_command(
        port, "--model", "qwen3-tiny", "--trust-request-chat-template", *server_args
    )
    server = ServerProcess(command, port)
    try:
        for name in args.kinds:
            print(f"{name}-amplifying template, server args {server_args or 'default'}")
            asyncio.run(run(server.url, server.process.pid, AMPLIFY[name], args.bad))
        if not args.no_indent:
            asyncio.run(indent(server.url))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
