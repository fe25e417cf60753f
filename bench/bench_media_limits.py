"""One request with many large images: the server's CPU and peak memory for it (issue 9, item 8).

Starts a qwen2-vl-tiny server, resets its peak-RSS mark (``/proc/PID/clear_refs``), sends one
``/tokenize`` request whose messages hold ``--images`` distinct, highly compressible PNGs of
``--size``² pixels as ``data:`` URLs, and prints the answer's status and message, the server's
CPU seconds for the request and its peak RSS above the resident size before it. Then one small
image request shows the server still serves. Extra arguments after ``--`` go to the server.

    .venv/bin/python bench/bench_media_limits.py [--images 12] [--size 5000] [-- --flag ...]
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serverbench import ServerProcess, cpu_seconds, free_port, tokenwire_command


def flat_png(size: int, index: int) -> bytes:
    """A one-colour PNG: a few dozen KB on the wire, ``size``² pixels once decoded."""
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (index * 20 % 256, 100, 200)).save(buffer, "PNG")
    return buffer.getvalue()


def image_part(data: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=12)
    parser.add_argument("--size", type=int, default=5000)
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args, server_args = parser.parse_known_args()
    if args.smoke:
        args.images, args.size = 1, 256
    server_args = [a for a in server_args if a != "--"]

    images = [flat_png(args.size, i) for i in range(args.images)]
    parts = [image_part(data) for data in images]
    body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}]}
    request_bytes = len(httpx.Request("POST", "http://x", json=body).content)

    port = free_port()
    server = ServerProcess(tokenwire_command(port, "--model", "qwen2-vl-tiny", *server_args), port)
    pid = server.process.pid
    try:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            small = {"messages": [{"role": "user", "content": [image_part(flat_png(64, 0))]}]}
            assert client.post("/tokenize", json=small).status_code == 200  # warm up
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # peak RSS := current RSS
            rss_before = rss_kib(pid, "VmRSS")
            cpu_before = cpu_seconds(pid)
            started = time.perf_counter()
            response = client.post("/tokenize", json=body)
            wall = time.perf_counter() - started
            cpu = cpu_seconds(pid) - cpu_before
            peak = rss_kib(pid, "VmHWM") - rss_before
            after = client.post("/tokenize", json=small).status_code
    finally:
        server.stop()

    answer = response.json()
    detail = answer["error"]["message"] if "error" in answer else f"{answer['count']} tokens"
    print(
        f"{args.images} x {args.size}² PNG, request {request_bytes / 2**20:.2f} MiB, "
        f"server args {server_args or 'default'}"
    )
    print(f"  status {response.status_code}: {detail[:160]}")
    print(f"  wall {wall:.2f} s, server CPU {cpu:.2f} s, peak RSS +{peak / 2**20:.2f} GiB")
    print(f"  a small image request afterwards: {after}")


if __name__ == "__main__":
    main()
