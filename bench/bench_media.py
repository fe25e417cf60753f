"""Rollouts that reuse one image: the media cache against no cache, in one run.

Two qwen2-vl-tiny servers run one after the other, the default (media cache on) and
``--media-cache-bytes 0``; both fetch one PNG from a local 127.0.0.1 server. Each row sends the
same image in every request:

- ``render url``: chat render with ``image_url`` (bytes are fetched every time; a cache hit by
  content hash skips decode and processing; features' ``kwargs_data`` is serialised either way);
- ``render url+uuid``: the same with a ``uuid`` (a hit also skips the fetch);
- ``generate url``: ``/inference/v1/generate`` with ``content_parts`` and ``max_tokens=1``.

Requests/s are measured on the client, the server's CPU from /proc. The table gives the ratio
cache / no cache per row. On a shared machine absolute numbers move with the neighbours' load.

    .venv/bin/python bench/bench_media.py [--size 448] [--requests 200] [--clients 4]
"""

from __future__ import annotations

import argparse
import io
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serverbench import LoadResult, ServerProcess, free_port, run_load, tokenwire_command

IMAGE_PAD = "<|image_pad|>"


def noise_png(size: int) -> bytes:
    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


@contextmanager
def media_server(body: bytes) -> Iterator[str]:
    """Serves ``body`` at /image.png on 127.0.0.1; yields the URL."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/image.png"
    finally:
        httpd.shutdown()
        httpd.server_close()


def render_body(url: str, with_uuid: bool) -> Callable[[int], bytes]:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    if with_uuid:
        part["uuid"] = "bench-image"
    body = orjson.dumps(
        {
            "messages": [
                {"role": "user", "content": [part, {"type": "text", "text": "Describe it."}]}
            ],
            "max_tokens": 1,
        }
    )
    return lambda _: body


def generate_body(url: str, token_ids: list[int]) -> Callable[[int], bytes]:
    body = orjson.dumps(
        {
            "token_ids": token_ids,
            "content_parts": [{"type": "image_url", "url": url}],
            "sampling_params": {"temperature": 0.0, "max_tokens": 1},
        }
    )
    return lambda _: body


def one_pad_prompt(url: str, server: str) -> list[int]:
    """Render's ids with the image's pad run collapsed to one pad, as a content_parts client."""
    import httpx

    rendered = httpx.post(
        f"{server}/v1/chat/completions/render",
        content=render_body(url, with_uuid=False)(0),
        headers={"Content-Type": "application/json"},
        timeout=60,
    ).json()
    pad = rendered["features"]["mm_placeholders"]["image"][0]
    ids = rendered["token_ids"]
    return ids[: pad["offset"] + 1] + ids[pad["offset"] + pad["length"] :]


def measure(url: str, cache_args: list[str], requests: int, clients: int) -> dict[str, LoadResult]:
    port = free_port()
    command = tokenwire_command(
        port, "--model", "qwen2-vl-tiny", "--allow-private-media-networks", *cache_args
    )
    server = ServerProcess(command, port)
    try:
        pid = server.process.pid
        path = "/v1/chat/completions/render"
        results = {
            "render url": run_load(
                server.url, pid, path, render_body(url, False), clients=clients, requests=requests
            ),
            "render url+uuid": run_load(
                server.url, pid, path, render_body(url, True), clients=clients, requests=requests
            ),
        }
        token_ids = one_pad_prompt(url, server.url)
        results["generate url"] = run_load(
            server.url,
            pid,
            "/inference/v1/generate",
            generate_body(url, token_ids),
            clients=clients,
            requests=max(requests // 2, clients),
        )
        return results
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=448, help="image side in pixels")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: does it run")
    args = parser.parse_args()
    if args.smoke:
        args.size, args.requests, args.clients = 64, 4, 2

    image = noise_png(args.size)
    with media_server(image) as url:
        cached = measure(url, [], args.requests, args.clients)
        uncached = measure(url, ["--media-cache-bytes", "0"], args.requests, args.clients)

    print(
        f"\n{args.size}x{args.size} noise PNG ({len(image) / 1024:.0f} KiB), "
        f"{args.clients} clients, one image reused in every request\n"
    )
    print("| row | no cache req/s | cache req/s | ratio | no cache CPU ms/req | cache CPU ms/req |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for row, hit in cached.items():
        miss = uncached[row]
        print(
            f"| {row} | {miss.requests_per_s:.1f} | {hit.requests_per_s:.1f} | "
            f"{hit.requests_per_s / miss.requests_per_s:.2f}x | "
            f"{miss.cpu_us_per_request / 1000:.2f} | {hit.cpu_us_per_request / 1000:.2f} |"
        )


if __name__ == "__main__":
    main()
