"""Media answers and requests that must not hurt the server (issue 9, items 2 and 8), over HTTP.

The qwen2vl server fetches from a local media server that answers 3xx without ``Location`` and
compressed bodies; the per-request limits (images, pixels to decode) are checked against its
defaults, with innocent requests running beside the refused ones.
"""

from __future__ import annotations

import base64
import gzip
import io
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.conftest import Server, assert_error
from tests.test_multimodal import (
    IMAGE_PAD,
    generate,
    image_messages,
    image_part,
    png,
    png_bomb,
    refused_everywhere,
    render,
    tokenize,
)
from tokenwire.media.policy import (
    DEFAULT_MAX_IMAGE_PIXELS_PER_REQUEST,
    DEFAULT_MAX_IMAGES_PER_REQUEST,
)

SMALL = png(56, 56, seed=7)  # 4 placeholder tokens
ACCEPT_ENCODINGS: list[str | None] = []


def encoded(coding: str, data: bytes) -> bytes:
    if coding == "gzip":
        return gzip.compress(data)
    if coding == "deflate":
        return zlib.compress(data)
    return data  # br and the rest: the server must refuse by the header alone


class Handler(BaseHTTPRequestHandler):
    """``/bare/CODE``: that status, no Location, empty body; ``/encoded/CODING``: SMALL sent
    with ``Content-Encoding: CODING``; anything else: SMALL. Every request's Accept-Encoding
    header is recorded in ``ACCEPT_ENCODINGS``."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        kind, _, arg = self.path.strip("/").partition("/")
        headers: dict[str, str] = {}
        status, body = 200, SMALL
        if kind == "bare":
            status, body = int(arg), b""
        elif kind == "encoded":
            body = encoded(arg, SMALL)
            headers["Content-Encoding"] = arg
        ACCEPT_ENCODINGS.append(self.headers.get("Accept-Encoding"))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def vl(qwen2vl_server: Server) -> Iterator[httpx.Client]:
    with qwen2vl_server.client() as client:
        yield client


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def flat_png(size: int, shade: int) -> bytes:
    """A large one-colour PNG, small on the wire."""
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (shade, 90, 180)).save(buffer, "PNG")
    return buffer.getvalue()


def innocents_beside(client: httpx.Client, bad: Any, count: int = 4) -> httpx.Response:
    """Run ``bad()`` while ``count`` small image requests run; they must all succeed."""
    with ThreadPoolExecutor(count + 1) as pool:
        bad_future = pool.submit(bad)
        futures = [
            pool.submit(tokenize, client, image_messages(image_part(data_url(SMALL))))
            for _ in range(count)
        ]
        for future in futures:
            response = future.result(timeout=120)
            assert response.status_code == 200, response.text
            assert response.json()["tokens"].count(IMAGE_PAD) == 4
        return bad_future.result(timeout=120)


# -- item 2: 3xx without Location ------------------------------------------------------------


@pytest.mark.parametrize("code", [300, 301, 302, 303, 304, 307, 308])
def test_redirect_without_location_is_a_400(vl: httpx.Client, origin: str, code: int) -> None:
    # vl follows redirects; without them (the connector tests) the answer is the same rule.
    errors = refused_everywhere(vl, f"{origin}/bare/{code}", 400, "redirect without Location")
    assert all(f"answered {code}" in error["message"] for error in errors)


# -- item 8: compressed media and per-request limits -----------------------------------------


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "identity, gzip"])
def test_encoded_media_is_refused_undecoded(vl: httpx.Client, origin: str, coding: str) -> None:
    refused_everywhere(vl, f"{origin}/encoded/{coding}", 400, "media content encoding not accepted")


def test_identity_is_asked_for_and_accepted(vl: httpx.Client, origin: str) -> None:
    ACCEPT_ENCODINGS.clear()
    response = tokenize(vl, image_messages(image_part(f"{origin}/encoded/identity")))
    assert response.status_code == 200, response.text
    assert ACCEPT_ENCODINGS == ["identity"]


def test_too_many_images_is_a_400_before_any_fetch(vl: httpx.Client, origin: str) -> None:
    count = DEFAULT_MAX_IMAGES_PER_REQUEST + 1
    message = f"too many images in one request: {count} > {DEFAULT_MAX_IMAGES_PER_REQUEST}"
    parts = [image_part(data_url(SMALL)) for _ in range(count)]
    assert_error(render(vl, image_messages(*parts)), 400, message)
    bad = innocents_beside(vl, lambda: tokenize(vl, image_messages(*parts)))
    assert_error(bad, 400, "--max-images-per-request")
    content_parts = [{"type": "image_url", "url": data_url(SMALL)}] * count
    response = generate(vl, [1, *[IMAGE_PAD] * count, 2], content_parts=content_parts)
    assert_error(response, 400, message)
    # render's features sent back with too many images: refused before any tensor is decoded.
    features = {
        "mm_hashes": {"image": ["0" * 64] * count},
        "mm_placeholders": {"image": [{"offset": i, "length": 1} for i in range(count)]},
        "kwargs_data": {"image": ["x"] * count},
    }
    assert_error(generate(vl, [IMAGE_PAD] * count, features=features), 400, message)
    # At the limit the same parts pass.
    allowed = parts[:DEFAULT_MAX_IMAGES_PER_REQUEST]
    assert tokenize(vl, image_messages(*allowed)).status_code == 200


def test_pixel_budget_is_checked_from_the_headers(vl: httpx.Client) -> None:
    budget = DEFAULT_MAX_IMAGE_PIXELS_PER_REQUEST
    # Distinct headers (identical bytes would count once), each under the per-image guard,
    # together over the budget; their pixel data is a few bytes, so decoding any would fail.
    side = int((budget / 5) ** 0.5) + 1
    parts = [image_part(data_url(png_bomb(side, side + i))) for i in range(6)]
    response = innocents_beside(vl, lambda: tokenize(vl, image_messages(*parts)))
    error = assert_error(response, 400, "image pixels over the request budget")
    assert f"> {budget} pixels to decode (--max-image-pixels-per-request)" in error["message"]
    assert error["param"] == "messages"
    # One of them alone is within the budget, so it is decoded: and found invalid.
    assert_error(tokenize(vl, image_messages(parts[0])), 400, "invalid image")


def test_large_images_over_the_budget_cost_no_decoding(vl: httpx.Client) -> None:
    """The issue's case, smaller: large real PNGs (small on the wire) over the pixel budget."""
    side = 3000
    count = DEFAULT_MAX_IMAGE_PIXELS_PER_REQUEST // side**2 + 1
    assert count <= DEFAULT_MAX_IMAGES_PER_REQUEST
    parts = [image_part(data_url(flat_png(side, 10 * i))) for i in range(count)]
    response = innocents_beside(vl, lambda: render(vl, image_messages(*parts)))
    assert_error(response, 400, f"{count * side**2} > {DEFAULT_MAX_IMAGE_PIXELS_PER_REQUEST}")
