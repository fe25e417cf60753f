"""Multimodal token-in against real servers: render/tokenize/generate with images, the cache, SSRF.

Media is served by a threaded HTTP server on 127.0.0.1 that this module starts and that records
every request path, so a test can assert that no fetch happened. No request ever goes to a
non-loopback address: the refused addresses below are refused before any connection is made
(the private rule, or the allow-list, which is checked before DNS).
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import re
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.conftest import Server, assert_error

IMAGE_PAD = 151655  # <|image_pad|>
VISION_START = 151652
LARGE = 2**20 + 4096  # just over qwen2vl_server's --max-media-bytes
STALL_S = 6.0
SLOW_S = 0.8


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG whose header claims a huge image; the body is a few bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024, 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


IMAGES = {
    "a.png": png(112, 112, seed=0),  # 8x8 patches -> 16 placeholder tokens
    "b.png": png(112, 112, seed=1),
    "small.png": png(56, 56, seed=2),  # 4x4 patches -> 4 tokens
    "bomb.png": png_bomb(),
}


# -- the media server -----------------------------------------------------------------------


@dataclass
class MediaLog:
    paths: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def count(self, part: str) -> int:
        return sum(part in path for path in self.paths)


class MediaHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        log: MediaLog = self.server.log
        log.paths.append(self.path)
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._route(parts.path, query, log)

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _route(self, path: str, query: dict[str, str], log: MediaLog) -> None:
        name = path.rsplit("/", 1)[-1]
        if path.startswith("/img/") and name in IMAGES:
            self._send(200, IMAGES[name], {"Content-Type": "image/png"})
        elif path == "/redirect":
            self._send(302, b"", {"Location": query["to"]})
        elif path == "/big":
            self._send(200, b"\0" * LARGE)
        elif path == "/big-chunked":  # no Content-Length: the limit must hold while reading
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            piece = b"\0" * 65536
            for _ in range(LARGE // len(piece) + 2):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        elif path.startswith("/slow/") and name in IMAGES:
            time.sleep(SLOW_S)
            self._send(200, IMAGES[name], {"Content-Type": "image/png"})
        elif path == "/stall":
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.flush()
            log.stop.wait(STALL_S)
        elif path.startswith("/status/"):
            self._send(int(name), b"nope")
        else:
            self._send(404, b"not found")


@dataclass
class MediaServer:
    port: int
    log: MediaLog

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@pytest.fixture(scope="module")
def media() -> Iterator[MediaServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), MediaHandler)
    httpd.daemon_threads = True
    httpd.log = MediaLog()  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield MediaServer(httpd.server_address[1], httpd.log)  # type: ignore[attr-defined]
    finally:
        httpd.log.stop.set()  # type: ignore[attr-defined]
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def vl(qwen2vl_server: Server) -> Iterator[httpx.Client]:
    with qwen2vl_server.client() as client:
        yield client


@pytest.fixture(scope="module")
def strict(qwen2vl_strict_server: Server) -> Iterator[httpx.Client]:
    with qwen2vl_strict_server.client() as client:
        yield client


# -- request helpers ------------------------------------------------------------------------


def unique(path: str) -> str:
    """A path the media log has never seen, so fetch counts are exact per test."""
    return f"{path}?n={uuid.uuid4().hex[:8]}"


def image_messages(*parts: dict[str, Any], text: str = "Describe.") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def image_part(url: str, uuid_: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    if uuid_ is not None:
        part["uuid"] = uuid_
    return part


def render(client: httpx.Client, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    return client.post("/v1/chat/completions/render", json={"messages": messages, **extra})


def tokenize(client: httpx.Client, messages: list[dict[str, Any]]) -> httpx.Response:
    return client.post("/tokenize", json={"messages": messages})


def generate(client: httpx.Client, token_ids: list[int], **extra: Any) -> httpx.Response:
    sampling = {"temperature": 0.0, "max_tokens": 4, "logprobs": 5}
    sampling.update(extra.pop("sampling", {}))
    return client.post(
        "/inference/v1/generate",
        json={"token_ids": token_ids, "sampling_params": sampling, **extra},
    )


def collapse_pads(token_ids: list[int]) -> list[int]:
    """Render's expanded ids with each run of image pads back to one pad, as a client writes."""
    out: list[int] = []
    for token in token_ids:
        if token == IMAGE_PAD and out and out[-1] == IMAGE_PAD:
            continue
        out.append(token)
    return out


def cache_hits(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    match = re.search(r'^tokenwire_media_cache_hits_total\{modality="image"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def engine_takes_media(client: httpx.Client, media: MediaServer) -> bool:
    """False until the hf engine runs images; generate tests skip rather than fail then."""
    rendered = render(client, image_messages(image_part(media.url("/img/small.png"))))
    body = rendered.json()
    response = generate(client, body["token_ids"], features=body["features"])
    return response.status_code == 200


@pytest.fixture(scope="module")
def engine_media(vl: httpx.Client, media: MediaServer) -> None:
    if not engine_takes_media(vl, media):
        pytest.skip("the hf engine does not run media yet")


# -- render and tokenize --------------------------------------------------------------------


def test_render_expands_placeholders_and_returns_features(
    vl: httpx.Client, media: MediaServer
) -> None:
    text_only = render(vl, [{"role": "user", "content": "Describe."}]).json()["token_ids"]
    response = render(vl, image_messages(image_part(media.url("/img/a.png"))))
    assert response.status_code == 200, response.text
    body = response.json()
    ids = body["token_ids"]
    features = body["features"]
    (placeholder,) = features["mm_placeholders"]["image"]
    assert placeholder["length"] == 16  # 112x112: 8x8 patches, 2x2 merge
    offset = placeholder["offset"]
    assert ids[offset - 1] == VISION_START
    assert ids[offset : offset + 16] == [IMAGE_PAD] * 16
    assert ids.count(IMAGE_PAD) == 16
    # The template adds <|vision_start|><|image_pad|><|vision_end|>; the pad became 16.
    assert len(ids) == len(text_only) + 3 + 15
    (mm_hash,) = features["mm_hashes"]["image"]
    assert re.fullmatch(r"[0-9a-f]{64}", mm_hash)
    (kwargs,) = features["kwargs_data"]["image"]
    assert len(base64.b64decode(kwargs)) > 64 * 1176 * 4


def test_chat_tokenize_counts_expanded_placeholders(vl: httpx.Client, media: MediaServer) -> None:
    messages = image_messages(
        image_part(media.url("/img/a.png")), {"type": "image", "image": media.url("/img/small.png")}
    )
    tokenized = tokenize(vl, messages)
    assert tokenized.status_code == 200, tokenized.text
    rendered = render(vl, messages).json()
    assert tokenized.json()["tokens"] == rendered["token_ids"]
    assert tokenized.json()["count"] == len(rendered["token_ids"])
    lengths = [p["length"] for p in rendered["features"]["mm_placeholders"]["image"]]
    assert lengths == [16, 4]
    assert rendered["token_ids"].count(IMAGE_PAD) == 20


def test_images_of_one_request_are_fetched_concurrently(
    vl: httpx.Client, media: MediaServer
) -> None:
    parts = [image_part(media.url(unique(f"/slow/{name}"))) for name in ("a.png", "b.png")]
    started = time.monotonic()
    response = tokenize(vl, image_messages(*parts))
    elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert response.json()["tokens"].count(IMAGE_PAD) == 32
    assert elapsed < 2 * SLOW_S, f"{elapsed:.2f} s: fetched one after the other"


def test_local_file_inside_the_allowed_folder(vl: httpx.Client, vl_media_dir: Path) -> None:
    (vl_media_dir / "inside.png").write_bytes(IMAGES["small.png"])
    response = tokenize(vl, image_messages(image_part(f"file://{vl_media_dir}/inside.png")))
    assert response.status_code == 200, response.text
    assert response.json()["tokens"].count(IMAGE_PAD) == 4


def test_data_url_image(vl: httpx.Client) -> None:
    data = base64.b64encode(IMAGES["small.png"]).decode()
    response = tokenize(vl, image_messages(image_part(f"data:image/png;base64,{data}")))
    assert response.status_code == 200, response.text
    assert response.json()["tokens"].count(IMAGE_PAD) == 4


# -- generate -------------------------------------------------------------------------------


def test_content_parts_and_features_give_the_same_output(
    vl: httpx.Client, media: MediaServer, engine_media: None
) -> None:
    url = media.url("/img/a.png")
    rendered = render(vl, image_messages(image_part(url))).json()
    by_features = generate(vl, rendered["token_ids"], features=rendered["features"])
    assert by_features.status_code == 200, by_features.text
    one_pad = collapse_pads(rendered["token_ids"])
    assert one_pad.count(IMAGE_PAD) == 1
    parts = [{"type": "image_url", "url": url}]
    by_parts = generate(vl, one_pad, content_parts=parts)
    assert by_parts.status_code == 200, by_parts.text
    # Render's already expanded ids are accepted with content_parts too.
    by_parts_expanded = generate(vl, rendered["token_ids"], content_parts=parts)
    assert by_parts_expanded.status_code == 200, by_parts_expanded.text
    outputs = [r.json() for r in (by_features, by_parts, by_parts_expanded)]
    ids = [o["choices"][0]["token_ids"] for o in outputs]
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) >= 1
    logprobs = [o["choices"][0]["logprobs"]["content"][0]["logprob"] for o in outputs]
    assert logprobs[0] == pytest.approx(logprobs[1], abs=1e-5)
    assert all(o["usage"]["prompt_tokens"] == len(rendered["token_ids"]) for o in outputs)


def test_a_different_image_changes_the_logits(
    vl: httpx.Client, media: MediaServer, engine_media: None
) -> None:
    rendered = render(vl, image_messages(image_part(media.url("/img/a.png")))).json()
    one_pad = collapse_pads(rendered["token_ids"])
    tops = []
    for name in ("a.png", "b.png"):
        parts = [{"type": "image_url", "url": media.url(f"/img/{name}")}]
        response = generate(vl, one_pad, content_parts=parts)
        assert response.status_code == 200, response.text
        first = response.json()["choices"][0]["logprobs"]["content"][0]
        tops.append({entry["token"]: entry["logprob"] for entry in first["top_logprobs"]})
    shared = set(tops[0]) & set(tops[1])
    assert set(tops[0]) != set(tops[1]) or any(
        abs(tops[0][token] - tops[1][token]) > 1e-4 for token in shared
    )


@pytest.mark.hf_only  # the hf engine's prefix cache
def test_an_image_change_misses_the_prefix_cache(
    vl: httpx.Client, media: MediaServer, engine_media: None
) -> None:
    """The same ids with another image reuse no KV: prompts with images bypass the prefix cache
    (their KV depends on pixels the ids do not name), even after the same ids ran twice."""
    text = "Describe every colour and shape in this picture, then its mood. " * 6
    rendered = render(vl, image_messages(image_part(media.url("/img/a.png")), text=text)).json()
    one_pad = collapse_pads(rendered["token_ids"])
    firsts = []
    for name in ("a.png", "a.png", "b.png"):
        parts = [{"type": "image_url", "url": media.url(f"/img/{name}")}]
        response = generate(vl, one_pad, content_parts=parts)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["prompt_tokens"] > 64
        assert "prompt_tokens_details" not in body["usage"]
        firsts.append(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"])
    assert firsts[0] == firsts[1]
    assert firsts[2] != firsts[0]


def test_chat_completions_with_an_image(
    vl: httpx.Client, media: MediaServer, engine_media: None
) -> None:
    messages = image_messages(image_part(media.url("/img/a.png")))
    rendered = render(vl, messages).json()
    response = vl.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0}
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    by_features = generate(vl, rendered["token_ids"], features=rendered["features"])
    assert response.json()["usage"]["completion_tokens"] == len(
        by_features.json()["choices"][0]["token_ids"]
    )


def test_features_from_the_cache_by_mm_hash(
    vl: httpx.Client, media: MediaServer, engine_media: None
) -> None:
    rendered = render(vl, image_messages(image_part(media.url("/img/a.png")))).json()
    features = {**rendered["features"], "kwargs_data": {"image": [None]}}
    with_cache = generate(vl, rendered["token_ids"], features=features)
    assert with_cache.status_code == 200, with_cache.text
    full = generate(vl, rendered["token_ids"], features=rendered["features"])
    assert with_cache.json()["choices"][0]["token_ids"] == full.json()["choices"][0]["token_ids"]


def test_features_are_validated(vl: httpx.Client, media: MediaServer) -> None:
    rendered = render(vl, image_messages(image_part(media.url("/img/a.png")))).json()
    ids, features = rendered["token_ids"], rendered["features"]
    (placeholder,) = features["mm_placeholders"]["image"]

    def with_ranges(*ranges: dict[str, int], hashes: int = 1) -> dict[str, Any]:
        return {
            "mm_hashes": {"image": features["mm_hashes"]["image"] * hashes},
            "mm_placeholders": {"image": list(ranges)},
            "kwargs_data": {"image": features["kwargs_data"]["image"] * hashes},
        }

    cases = [
        (with_ranges(placeholder, placeholder), "mm_placeholders"),
        (with_ranges({"offset": len(ids) - 4, "length": 16}), "outside token_ids"),
        (with_ranges({**placeholder, "offset": placeholder["offset"] + 1}), "image"),
        (
            with_ranges(
                placeholder, {**placeholder, "offset": placeholder["offset"] + 8}, hashes=2
            ),
            "overlap",
        ),
        ({**features, "kwargs_data": {"image": ["not base64!"]}}, "not base64"),
        (
            {**features, "mm_hashes": {"image": ["0" * 64]}, "kwargs_data": {"image": [None]}},
            "no cached image for mm_hash",
        ),
        ({**features, "mm_hashes": {"audio": ["x"]}}, "no audio input"),
    ]
    for bad, message in cases:
        assert_error(generate(vl, ids, features=bad), 400, message)
    both = generate(vl, ids, features=features, content_parts=[{"type": "image_url", "url": "x"}])
    assert_error(both, 400, "content_parts and features are mutually exclusive")


def test_content_parts_are_validated(vl: httpx.Client, media: MediaServer) -> None:
    url = media.url("/img/a.png")
    ids = [1, 2, IMAGE_PAD, 3]
    two = [{"type": "image_url", "url": url}] * 2
    assert_error(generate(vl, ids, content_parts=two), 400, "2 images")
    unknown = [{"type": "pdf_url", "url": url}]
    assert_error(generate(vl, ids, content_parts=unknown), 400, "content_parts")
    audio = [{"type": "audio_url", "url": url}]
    assert_error(generate(vl, ids, content_parts=audio), 400, "no audio input")
    missing = [{"type": "image_url", "url": url}, {"type": "image_url", "uuid": "abc-missing"}]
    error = assert_error(generate(vl, ids, content_parts=missing), 400)
    assert "content_parts[1]: no cached image for uuid 'abc-missing'" in error["message"]


def test_chat_audio_and_video_are_refused(vl: httpx.Client, media: MediaServer) -> None:
    url = media.url("/img/a.png")
    audio = {"type": "audio_url", "audio_url": {"url": url}}
    assert_error(render(vl, image_messages(audio)), 400, "no audio input")
    video = {"type": "video_url", "video_url": {"url": url}}
    assert_error(tokenize(vl, image_messages(video)), 400, "no video input")


def test_text_only_model_refuses_media(smollm2: httpx.Client, media: MediaServer) -> None:
    before = len(media.log.paths)
    messages = image_messages(image_part(media.url("/img/a.png")))
    assert_error(render(smollm2, messages), 400, "this model takes no multimodal input")
    parts = [{"type": "image_url", "url": media.url("/img/a.png")}]
    error = assert_error(generate(smollm2, [1, 2, 3], content_parts=parts), 400)
    assert "takes no multimodal input" in error["message"]
    assert len(media.log.paths) == before


# -- the cache ------------------------------------------------------------------------------


def test_same_uuid_hits_the_cache_without_fetching(vl: httpx.Client, media: MediaServer) -> None:
    path = unique("/img/b.png")
    key = f"rollout-{uuid.uuid4().hex}"
    hits = cache_hits(vl)
    first = render(vl, image_messages(image_part(media.url(path), key)))
    assert first.status_code == 200, first.text
    assert media.log.count(path) == 1
    # Same uuid with the url again, then the uuid alone: no fetch, two cache hits.
    again = render(vl, image_messages(image_part(media.url(path), key)))
    assert again.json()["token_ids"] == first.json()["token_ids"]
    only_uuid = tokenize(vl, image_messages({"type": "image", "uuid": key}))
    assert only_uuid.status_code == 200, only_uuid.text
    assert only_uuid.json()["tokens"] == first.json()["token_ids"]
    assert media.log.count(path) == 1
    assert cache_hits(vl) >= hits + 2


def test_generate_with_a_cached_uuid_alone(
    vl: httpx.Client, media: MediaServer, engine_media: None
) -> None:
    path = unique("/img/a.png")
    key = f"rollout-{uuid.uuid4().hex}"
    first = render(vl, image_messages(image_part(media.url(path), key))).json()
    one_pad = collapse_pads(first["token_ids"])
    by_url = generate(vl, one_pad, content_parts=[{"type": "image_url", "url": media.url(path)}])
    by_uuid = generate(vl, one_pad, content_parts=[{"type": "image_url", "uuid": key}])
    assert by_uuid.status_code == 200, by_uuid.text
    assert by_uuid.json()["choices"][0]["token_ids"] == by_url.json()["choices"][0]["token_ids"]
    assert media.log.count(path) == 2  # render and the url request; never the uuid request


def test_same_bytes_skip_processing_by_content_hash(vl: httpx.Client, media: MediaServer) -> None:
    hits = cache_hits(vl)
    for _ in range(2):
        response = tokenize(vl, image_messages(image_part(media.url(unique("/img/small.png")))))
        assert response.status_code == 200, response.text
    assert cache_hits(vl) >= hits + 1


# -- SSRF and limits, through every entry point ---------------------------------------------


def refused_everywhere(
    client: httpx.Client, url: str, status: int, message: str
) -> list[dict[str, Any]]:
    """The same refusal from chat render, chat tokenize and generate's content_parts."""
    errors = [
        assert_error(render(client, image_messages(image_part(url))), status, message),
        assert_error(tokenize(client, image_messages(image_part(url))), status, message),
        assert_error(
            generate(client, [1, IMAGE_PAD, 2], content_parts=[{"type": "image_url", "url": url}]),
            status,
            message,
        ),
    ]
    return errors


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "[::1]",
        "169.254.169.254",
        "10.0.0.1",
        "172.16.0.1",
        "192.168.1.1",
        "[fc00::1]",
        "0.0.0.0",
        "[::ffff:127.0.0.1]",
        "localhost",  # a name that resolves to a private address
    ],
)
def test_private_addresses_are_refused(strict: httpx.Client, host: str) -> None:
    refused_everywhere(strict, f"http://{host}:9/img/a.png", 400, "private address")


def test_strict_server_refuses_loopback_without_connecting(
    strict: httpx.Client, media: MediaServer
) -> None:
    path = unique("/img/a.png")
    refused_everywhere(strict, media.url(path), 400, "private address")
    assert media.log.count(path) == 0


def test_strict_server_refuses_local_files(strict: httpx.Client) -> None:
    refused_everywhere(strict, "file:///etc/hostname", 400, "local media files are not allowed")


def test_host_off_the_allow_list(vl: httpx.Client) -> None:
    # The allow-list is checked before DNS: nothing is resolved or contacted.
    refused_everywhere(vl, "http://media.example.com/a.png", 400, "media domain not allowed")


def test_redirect_hops_are_rechecked(vl: httpx.Client, media: MediaServer) -> None:
    followed = tokenize(
        vl, image_messages(image_part(media.url(f"/redirect?to={media.url('/img/small.png')}")))
    )
    assert followed.status_code == 200, followed.text
    # The first hop is allowed; the target ([::1], 169.254.169.254) is off the allow-list.
    for target in (f"http://[::1]:{media.port}/img/a.png", "http://169.254.169.254/latest/"):
        path = unique("/redirect") + f"&to={target}"
        refused_everywhere(vl, media.url(path), 400, "media domain not allowed")


def test_local_files_outside_the_folder(vl: httpx.Client, vl_media_dir: Path) -> None:
    outside = vl_media_dir.parent / "outside-secret.png"
    outside.write_bytes(IMAGES["small.png"])
    link = vl_media_dir / "link.png"
    if not link.exists():
        os.symlink(outside, link)
    for url in (
        f"file://{vl_media_dir}/../{outside.name}",
        f"file://{link}",
        "file:///etc/passwd",
    ):
        refused_everywhere(vl, url, 400, "file outside allowed local media path")


@pytest.mark.parametrize("path", ["/big", "/big-chunked"])
def test_body_over_the_limit(vl: httpx.Client, media: MediaServer, path: str) -> None:
    refused_everywhere(vl, media.url(unique(path)), 400, "media too large")


def test_data_url_over_the_limit(vl: httpx.Client) -> None:
    data = base64.b64encode(b"\0" * LARGE).decode()
    assert_error(
        tokenize(vl, image_messages(image_part(f"data:image/png;base64,{data}"))),
        400,
        "media too large",
    )


def test_stalling_server_times_out(vl: httpx.Client, media: MediaServer) -> None:
    started = time.monotonic()
    assert_error(
        render(vl, image_messages(image_part(media.url(unique("/stall"))))),
        400,
        "media fetch timed out",
    )
    assert time.monotonic() - started < STALL_S - 1


def test_decompression_bomb(vl: httpx.Client, media: MediaServer) -> None:
    refused_everywhere(vl, media.url("/img/bomb.png"), 400, "decompression bomb")


def test_not_an_image(vl: httpx.Client, media: MediaServer) -> None:
    data = base64.b64encode(b"plain text, not pixels").decode()
    refused_everywhere(vl, f"data:image/png;base64,{data}", 400, "invalid image")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png,rawbytes", "data URL must be base64"),
        ("data:image/png;base64,@@not-base64@@", "invalid base64 in data URL"),
        ("ftp://127.0.0.1/a.png", "unsupported URL scheme"),
        ("gopher://127.0.0.1/", "unsupported URL scheme"),
        ("javascript:alert(1)", "unsupported URL scheme"),
    ],
)
def test_bad_urls(vl: httpx.Client, url: str, message: str) -> None:
    refused_everywhere(vl, url, 400, message)


@pytest.mark.parametrize(("code", "status"), [(404, 422), (403, 422), (500, 400)])
def test_remote_status(vl: httpx.Client, media: MediaServer, code: int, status: int) -> None:
    refused_everywhere(vl, media.url(unique(f"/status/{code}")), status, f"answered {code}")
