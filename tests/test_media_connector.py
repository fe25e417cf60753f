"""The guarded media connector and loaders, against real HTTP(S) servers on loopback only.

No test sends traffic to a non-loopback address: names are resolved by a numeric-only resolver or
a fake one (the connector's ``resolver`` seam), and private addresses are refused before any
connection is made.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import ipaddress
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from PIL import Image

from tokenwire.media import connector as connector_module
from tokenwire.media.connector import MediaConnector, SystemResolver
from tokenwire.media.errors import MediaFetchFailed, MediaRefused, Rule
from tokenwire.media.loaders import load_image
from tokenwire.media.pinning import PinnedNetworkBackend, PinTable
from tokenwire.media.policy import MediaPolicy, is_public_address

LIMIT = 4096
STALL_MAX_S = 5.0


# -- local servers --------------------------------------------------------------------------


@dataclass
class ServerLog:
    requests: list[tuple[str, str]] = field(default_factory=list)  # (path, Host header)
    stop: threading.Event = field(default_factory=threading.Event)


class MediaHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        log: ServerLog = self.server.log
        log.requests.append((self.path, self.headers.get("Host", "")))
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._route(parts.path, query, log)

    def _route(self, path: str, query: dict[str, str], log: ServerLog) -> None:
        if path == "/ok":
            self._send(200, b"hello")
        elif path == "/exact":
            self._send(200, b"x" * LIMIT)
        elif path == "/host":
            self._send(200, self.headers.get("Host", "").encode())
        elif path == "/redirect":
            self._send(302, headers={"Location": query["to"]})
        elif path == "/loop":
            self._send(302, headers={"Location": "/loop"})
        elif path == "/status":
            self._send(int(query["code"]), b"nope")
        elif path == "/bare":  # a 3xx without Location
            self._send(int(query["code"]))
        elif path == "/encoded":
            body = zlib.compress(b"x" * LIMIT * 100)  # a bomb once decoded
            self._send(200, body, {"Content-Encoding": query["coding"]})
        elif path == "/accept":
            self._send(200, self.headers.get("Accept-Encoding", "").encode())
        elif path == "/big-cl":
            # Claims more than the limit; the connector must refuse before reading the body.
            self.send_response(200)
            self.send_header("Content-Length", str(LIMIT + 1))
            self.end_headers()
            self.wfile.write(b"x" * (LIMIT + 1))
        elif path == "/big-chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(8):
                self.wfile.write(b"%x\r\n%s\r\n" % (1024, b"x" * 1024))
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/big-close":
            # No Content-Length, no chunking: the body ends when the connection closes.
            self.close_connection = True
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"x" * (LIMIT * 2))
        elif path == "/stall":
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b"0123456789")
            self.wfile.flush()
            log.stop.wait(STALL_MAX_S)
        elif path == "/drip":
            # One byte every 50 ms: each read is quick, only the overall deadline can stop it.
            self.send_response(200)
            self.send_header("Content-Length", "200")
            self.end_headers()
            for _ in range(200):
                if log.stop.wait(0.05):
                    break
                self.wfile.write(b"x")
                self.wfile.flush()
        else:
            self._send(404, b"no such path")


@dataclass
class Server:
    host: str
    port: int
    log: ServerLog

    def url(self, path: str, host: str | None = None, scheme: str = "http") -> str:
        return f"{scheme}://{host or self.host}:{self.port}{path}"


@contextlib.contextmanager
def serve(host: str, context: ssl.SSLContext | None = None) -> Iterator[Server]:
    httpd = ThreadingHTTPServer((host, 0), MediaHandler)
    httpd.daemon_threads = True
    httpd.log = ServerLog()  # type: ignore[attr-defined]
    if context is not None:
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield Server(host, httpd.server_address[1], httpd.log)  # type: ignore[attr-defined]
    finally:
        httpd.log.stop.set()  # type: ignore[attr-defined]
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with serve("127.0.0.1") as srv:
        yield srv


# -- helpers --------------------------------------------------------------------------------


async def numeric_resolve(host: str, port: int) -> list[str]:
    """Like the system resolver, but only for numeric forms: never sends a DNS query."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    return [str(info[4][0]) for info in infos]


def fake_resolver(table: dict[str, Sequence[str]]) -> Callable[[str, int], Awaitable[list[str]]]:
    async def resolve(host: str, port: int) -> list[str]:
        if host in table:
            return list(table[host])
        return await numeric_resolve(host, port)

    return resolve


def fetch(url: str, policy: MediaPolicy | None = None, **kwargs: Any) -> bytes:
    kwargs.setdefault("resolver", numeric_resolve)

    async def go() -> bytes:
        connector = MediaConnector(policy or MediaPolicy(), **kwargs)
        try:
            return await connector.fetch(url)
        finally:
            await connector.aclose()

    return asyncio.run(go())


def refused(url: str, policy: MediaPolicy | None = None, **kwargs: Any) -> MediaRefused:
    with pytest.raises(MediaRefused) as info:
        fetch(url, policy, **kwargs)
    assert info.value.status == 400
    assert info.value.message.startswith(info.value.rule)
    return info.value


LOCAL = MediaPolicy(allow_private_networks=True, max_bytes=LIMIT, timeout_s=2.0)


# -- address rules --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "10.0.0.1",
        "10.255.255.255",
        "172.16.0.1",
        "172.31.255.254",
        "192.168.1.1",
        "127.0.0.1",
        "127.8.9.10",
        "169.254.169.254",
        "0.0.0.0",
        "100.64.0.1",
        "100.127.255.254",
        "224.0.0.1",
        "239.255.255.250",
        "240.0.0.1",
        "255.255.255.255",
        "192.0.2.1",
        "198.18.0.1",
        "::",
        "::1",
        "fc00::1",
        "fd12:3456::1",
        "fe80::1",
        "fec0::1",
        "ff02::1",
        "2001:db8::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "::ffff:169.254.169.254",
        "::127.0.0.1",
        "2002:7f00:1::",  # 6to4 around 127.0.0.1
        "2002:a00:1::",  # 6to4 around 10.0.0.1
        "64:ff9b::a00:1",  # NAT64 around 10.0.0.1
        "64:ff9b::7f00:1",
    ],
)
def test_non_public_addresses_are_refused(address: str) -> None:
    assert not is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize(
    "address", ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "::ffff:8.8.8.8"]
)
def test_public_addresses_pass(address: str) -> None:
    assert is_public_address(ipaddress.ip_address(address))


# -- SSRF suite: each refused with its rule, before any connection --------------------------


def _no_dns(host: str, port: int) -> Awaitable[list[str]]:
    raise AssertionError(f"resolver called for {host}")


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/x",
        "http://10.0.0.1/x",
        "http://10.1.2.3:8080/latest",
        "http://172.16.0.1/x",
        "http://172.31.0.1/x",
        "http://192.168.0.1/x",
        "http://169.254.169.254/latest/meta-data/",
        "http://0.0.0.0/x",
        "http://100.64.0.1/x",
        "http://[::1]/x",
        "http://[::]/x",
        "http://[fc00::1]/x",
        "http://[fd00::abcd]/x",
        "http://[fe80::1]/x",
        "http://[::ffff:127.0.0.1]/x",
        "http://[::ffff:a9fe:a9fe]/x",
        "https://[::ffff:10.0.0.1]/x",
        "https://192.168.1.1/x",
    ],
)
def test_literal_private_addresses_refused_without_resolving(url: str) -> None:
    error = refused(url, resolver=_no_dns)
    assert error.rule == Rule.PRIVATE_ADDRESS


@pytest.mark.parametrize(
    "url",
    [
        "http://2130706433/",
        "http://0x7f.1/",
        "http://0x7f000001/",
        "http://017700000001/",
        "http://127.1/",
        "http://167772161/",  # 10.0.0.1
        "http://0xa9.0xfe.0xa9.0xfe/",  # 169.254.169.254
    ],
)
def test_integer_and_odd_host_forms_are_normalised_then_refused(url: str) -> None:
    assert refused(url).rule == Rule.PRIVATE_ADDRESS


def test_dotted_octal_host_is_refused_as_invalid() -> None:
    # httpx rejects a dotted quad with an out-of-range octet before any resolution.
    assert refused("http://0177.0.0.1/", resolver=_no_dns).rule == Rule.INVALID_URL


def test_system_resolver_normalises_integer_hosts() -> None:
    # glibc parses numeric forms itself; no DNS query is made for these.
    assert asyncio.run(SystemResolver()("2130706433", 80)) == ["127.0.0.1"]
    assert asyncio.run(SystemResolver()("0x7f.1", 80)) == ["127.0.0.1"]


def test_localhost_name_is_refused() -> None:
    error = refused("http://localhost/x", resolver=SystemResolver())
    assert error.rule == Rule.PRIVATE_ADDRESS


@pytest.mark.parametrize(
    "answers",
    [["10.0.0.1"], ["192.168.7.7"], ["169.254.169.254"], ["fc00::5"], ["8.8.8.8", "10.0.0.1"]],
)
def test_hostname_resolving_to_private_is_refused(answers: list[str]) -> None:
    # Any private answer refuses, even next to a public one.
    resolver = fake_resolver({"internal.test": answers})
    assert refused("http://internal.test/x", resolver=resolver).rule == Rule.PRIVATE_ADDRESS


def test_host_off_the_allow_list(server: Server) -> None:
    policy = MediaPolicy(allowed_domains=frozenset({"media.test"}), allow_private_networks=True)
    before = len(server.log.requests)
    for url in [
        server.url("/ok"),
        "http://evil.test/x",
        "http://media.test.evil.test/x",
        "http://evilmedia.test/x",
        "http://sub.media.test/x",
    ]:
        error = refused(url, policy, resolver=_no_dns)
        assert error.rule == Rule.DOMAIN_NOT_ALLOWED
    assert len(server.log.requests) == before


def test_allow_list_is_case_insensitive_and_normalised() -> None:
    policy = MediaPolicy(allowed_domains=("Media.TEST", "bücher.de"))  # type: ignore[arg-type]
    assert policy.allowed_domains == frozenset({"media.test", "xn--bcher-kva.de"})
    assert policy.host_allowed("media.test")
    resolver = fake_resolver({"media.test": ["10.0.0.1"], "xn--bcher-kva.de": ["10.0.0.2"]})
    # Allowed by name, still refused by address: the two checks are independent.
    assert refused("http://MEDIA.test/x", policy, resolver=resolver).rule == Rule.PRIVATE_ADDRESS
    assert refused("http://bücher.de/x", policy, resolver=resolver).rule == Rule.PRIVATE_ADDRESS


@pytest.mark.parametrize(
    "url",
    ["ftp://example.com/a.png", "gopher://x/", "javascript:alert(1)", "example.com/a.png", "x"],
)
def test_unknown_scheme(url: str) -> None:
    assert refused(url).rule == Rule.UNSUPPORTED_SCHEME


def test_credentials_in_url_refused() -> None:
    assert refused("http://user:pw@8.8.8.8/x", resolver=_no_dns).rule == Rule.CREDENTIALS_IN_URL


# -- successful fetches and pinning ---------------------------------------------------------


def test_http_fetch_on_loopback_when_private_allowed(server: Server) -> None:
    assert fetch(server.url("/ok"), LOCAL) == b"hello"
    assert fetch(server.url("/exact"), LOCAL) == b"x" * LIMIT


def test_connection_is_pinned_to_the_vetted_address_with_the_original_host(server: Server) -> None:
    calls: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        calls.append(host)
        return ["127.0.0.1"]

    policy = MediaPolicy(allowed_domains=frozenset({"media.test"}), allow_private_networks=True)
    body = fetch(server.url("/host", host="media.test"), policy, resolver=resolver)
    assert body == f"media.test:{server.port}".encode()
    assert calls == ["media.test"]
    assert server.log.requests[-1] == ("/host", f"media.test:{server.port}")


def test_concurrent_fetches_share_one_connector(server: Server) -> None:
    policy = MediaPolicy(allowed_domains=frozenset({"media.test"}), allow_private_networks=True)
    resolver = fake_resolver({"media.test": ["127.0.0.1"]})

    async def go() -> list[bytes]:
        connector = MediaConnector(policy, resolver=resolver)
        try:
            url = server.url("/ok", host="media.test")
            return await asyncio.gather(*(connector.fetch(url) for _ in range(20)))
        finally:
            await connector.aclose()

    assert asyncio.run(go()) == [b"hello"] * 20


def test_dns_rebinding_answer_is_rechecked_each_fetch(server: Server) -> None:
    answers = iter([["127.0.0.1"], ["10.0.0.1"]])

    async def rebinding(host: str, port: int) -> list[str]:
        return next(answers)

    async def go() -> tuple[bytes, MediaRefused]:
        policy = MediaPolicy(allowed_domains=frozenset({"media.test"}))
        connector = MediaConnector(policy, resolver=rebinding)
        # First answer allowed only for this test: pretend 127.0.0.1 is public.
        real = connector_module.is_public_address
        try:
            connector_module.is_public_address = lambda ip: str(ip) == "127.0.0.1" or real(ip)
            first = await connector.fetch(server.url("/ok", host="media.test"))
            with pytest.raises(MediaRefused) as info:
                await connector.fetch(server.url("/ok", host="media.test"))
            return first, info.value
        finally:
            connector_module.is_public_address = real
            await connector.aclose()

    first, error = asyncio.run(go())
    assert first == b"hello"
    assert error.rule == Rule.PRIVATE_ADDRESS


def test_backend_never_connects_to_an_unpinned_host() -> None:
    import httpcore

    backend = PinnedNetworkBackend(PinTable())
    with pytest.raises(httpcore.ConnectError):
        asyncio.run(backend.connect_tcp("127.0.0.1", 9))


def test_pin_table_releases_pins() -> None:
    pins = PinTable()
    with pins.pinned("a.test", ["1.1.1.1"]):
        with pins.pinned("a.test", ["8.8.8.8"]):
            assert pins.lookup("a.test") == ("8.8.8.8",)
        assert pins.lookup("a.test") == ("8.8.8.8",)
    assert pins.lookup("a.test") == ()


# -- https: SNI and certificate verification against the hostname ---------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=media.test",
         "-addext", "subjectAltName=DNS:media.test"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return cert, key


def test_https_uses_sni_and_verifies_the_hostname(tls_files: tuple[Path, Path]) -> None:
    cert, key = tls_files
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(cert, key)
    seen_sni: list[str | None] = []
    server_context.sni_callback = lambda sock, name, ctx: seen_sni.append(name)
    client_context = ssl.create_default_context(cafile=str(cert))
    resolver = fake_resolver({"media.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
    policy = MediaPolicy(allow_private_networks=True, timeout_s=3.0)
    with serve("127.0.0.1", server_context) as tls:
        url = tls.url("/host", host="media.test", scheme="https")
        body = fetch(url, policy, resolver=resolver, ssl_context=client_context)
        assert body == f"media.test:{tls.port}".encode()
        assert seen_sni == ["media.test"]
        # Same address, other name: the certificate does not match, so the fetch fails.
        with pytest.raises(MediaFetchFailed) as info:
            fetch(tls.url("/host", host="other.test", scheme="https"), policy,
                  resolver=resolver, ssl_context=client_context)  # fmt: skip
        assert info.value.status == 400
        # And with the default trust store the self-signed certificate is rejected.
        with pytest.raises(MediaFetchFailed):
            fetch(url, policy, resolver=resolver)


# -- redirects ------------------------------------------------------------------------------


def test_redirects_are_refused_by_default(server: Server) -> None:
    error = refused(server.url(f"/redirect?to={server.url('/ok')}"), LOCAL)
    assert error.rule == Rule.REDIRECTS_NOT_ALLOWED


def test_redirect_followed_when_allowed(server: Server) -> None:
    policy = MediaPolicy(allow_private_networks=True, allow_redirects=True, max_bytes=LIMIT)
    assert fetch(server.url("/redirect?to=/ok"), policy) == b"hello"


def test_redirect_hop_off_the_allow_list_is_refused(server: Server) -> None:
    policy = MediaPolicy(
        allowed_domains=frozenset({"media.test"}), allow_private_networks=True, allow_redirects=True
    )
    resolver = fake_resolver({"media.test": ["127.0.0.1"]})
    before = len(server.log.requests)
    url = server.url(f"/redirect?to={server.url('/ok')}", host="media.test")
    error = refused(url, policy, resolver=resolver)
    assert error.rule == Rule.DOMAIN_NOT_ALLOWED
    assert [path for path, _ in server.log.requests[before:]] == [
        f"/redirect?to={server.url('/ok')}"
    ]


@pytest.mark.parametrize(
    "target",
    [
        "http://127.0.0.1:{port}/ok",
        "http://localhost:{port}/ok",
        "http://internal.test/ok",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::ffff:127.0.0.1]:{port}/ok",
        "http://2130706433:{port}/ok",
    ],
)
def test_redirect_to_a_private_address_is_refused(target: str) -> None:
    # The first hop is a server on 127.0.0.2 that this test treats as public; every other
    # address is judged by the real rules, so the redirect target must be refused.
    try:
        context = serve("127.0.0.2")
        public = context.__enter__()
    except OSError:
        pytest.skip("cannot bind 127.0.0.2")
    try:
        target = target.format(port=public.port)
        resolver = fake_resolver(
            {
                "public.test": ["127.0.0.2"],
                "internal.test": ["10.0.0.1"],
                "localhost": ["127.0.0.1"],
            }
        )

        async def go() -> MediaRefused:
            policy = MediaPolicy(allow_redirects=True, timeout_s=2.0)
            connector = MediaConnector(policy, resolver=resolver)
            real = connector_module.is_public_address
            connector_module.is_public_address = lambda ip: str(ip) == "127.0.0.2" or real(ip)
            try:
                with pytest.raises(MediaRefused) as info:
                    await connector.fetch(public.url(f"/redirect?to={target}", host="public.test"))
                return info.value
            finally:
                connector_module.is_public_address = real
                await connector.aclose()

        error = asyncio.run(go())
        assert error.rule == Rule.PRIVATE_ADDRESS
        assert len(public.log.requests) == 1
    finally:
        context.__exit__(None, None, None)


@pytest.mark.parametrize(
    ("target", "rule"),
    [
        ("file:///etc/passwd", Rule.UNSUPPORTED_SCHEME),
        ("ftp://x/", Rule.UNSUPPORTED_SCHEME),
        # httpx itself cannot join this Location onto an http URL.
        ("data:text/plain;base64,aGk=", Rule.INVALID_URL),
    ],
)
def test_redirect_to_another_scheme_is_refused(server: Server, target: str, rule: Rule) -> None:
    policy = MediaPolicy(allow_private_networks=True, allow_redirects=True)
    assert refused(server.url(f"/redirect?to={target}"), policy).rule == rule


@pytest.mark.parametrize("allow_redirects", [False, True])
@pytest.mark.parametrize("code", [300, 301, 302, 303, 304, 307, 308])
def test_3xx_without_location(server: Server, code: int, allow_redirects: bool) -> None:
    policy = MediaPolicy(allow_private_networks=True, allow_redirects=allow_redirects)
    error = refused(server.url(f"/bare?code={code}"), policy)
    assert error.rule == Rule.REDIRECT_WITHOUT_LOCATION
    assert f"answered {code}" in error.message


def test_too_many_redirects(server: Server) -> None:
    policy = MediaPolicy(allow_private_networks=True, allow_redirects=True)
    before = len(server.log.requests)
    assert refused(server.url("/loop"), policy).rule == Rule.TOO_MANY_REDIRECTS
    assert len(server.log.requests) - before == 6  # the request and five redirects


# -- size and time limits -------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/big-cl", "/big-chunked", "/big-close"])
def test_body_over_the_limit(server: Server, path: str) -> None:
    error = refused(server.url(path), LOCAL)
    assert error.rule == Rule.TOO_LARGE
    if path == "/big-cl":
        assert "Content-Length" in error.message


def test_stalling_server_times_out(server: Server) -> None:
    policy = MediaPolicy(allow_private_networks=True, timeout_s=0.4)
    start = time.monotonic()
    assert refused(server.url("/stall"), policy).rule == Rule.TIMED_OUT
    assert time.monotonic() - start < 2.0


def test_slow_drip_hits_the_overall_deadline(server: Server) -> None:
    policy = MediaPolicy(allow_private_networks=True, timeout_s=0.5)
    start = time.monotonic()
    assert refused(server.url("/drip"), policy).rule == Rule.TIMED_OUT
    assert time.monotonic() - start < 2.0


def test_identity_is_asked_for(server: Server) -> None:
    assert fetch(server.url("/accept"), LOCAL) == b"identity"


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "x-gzip", "identity, deflate"])
def test_encoded_bodies_are_refused(server: Server, coding: str) -> None:
    error = refused(server.url(f"/encoded?coding={coding}"), LOCAL)
    assert error.rule == Rule.ENCODED_BODY
    assert coding in error.message


# -- remote failures ------------------------------------------------------------------------


@pytest.mark.parametrize(("code", "status"), [(404, 422), (403, 422), (500, 400), (503, 400)])
def test_remote_status_mapping(server: Server, code: int, status: int) -> None:
    with pytest.raises(MediaFetchFailed) as info:
        fetch(server.url(f"/status?code={code}"), LOCAL)
    assert (info.value.status, info.value.remote_status) == (status, code)


def test_connection_refused_is_a_400() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(MediaFetchFailed) as info:
        fetch(f"http://127.0.0.1:{port}/x", LOCAL)
    assert info.value.status == 400


def test_unresolvable_host_is_a_400() -> None:
    with pytest.raises(MediaFetchFailed) as info:
        fetch("http://no-such-host.test/x")  # numeric-only resolver: fails without DNS
    assert info.value.status == 400


def test_dns_that_never_answers_holds_no_other_fetch(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names whose DNS never answers (the system resolver blocks, as with a silent name server)
    beside innocent fetches through the same connector: the innocent ones resolve, fetch and
    decode at once; the stuck ones fail at their own deadline. 40 stuck names: more than the
    event loop's default thread pool has workers on any machine (at most 32)."""
    release = threading.Event()
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if str(host).endswith(".hang.test"):
            release.wait(60)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    policy = MediaPolicy(allow_private_networks=True, timeout_s=1.5)

    async def go() -> tuple[list[bytes], float, list[BaseException]]:
        connector = MediaConnector(policy)  # the system resolver
        try:
            stuck = [
                asyncio.create_task(connector.fetch(f"http://h{i}.hang.test/x.png"))
                for i in range(40)
            ]
            await asyncio.sleep(0.1)
            start = time.monotonic()
            innocent = await asyncio.gather(
                *(connector.fetch(server.url("/ok", host="localhost")) for _ in range(4)),
                asyncio.to_thread(lambda: b"decoded"),  # an image decode's thread hop
            )
            took = time.monotonic() - start
            return innocent, took, await asyncio.gather(*stuck, return_exceptions=True)
        finally:
            release.set()
            await connector.aclose()

    innocent, took, stuck = asyncio.run(go())
    assert innocent == [b"hello"] * 4 + [b"decoded"]
    assert took < 1.0, f"innocent fetches took {took:.2f} s"
    assert all(isinstance(e, MediaRefused) and e.rule == Rule.TIMED_OUT for e in stuck), stuck


# -- data: ----------------------------------------------------------------------------------


def test_data_url() -> None:
    payload = base64.b64encode(b"\x89PNG fake").decode()
    assert fetch(f"data:image/png;base64,{payload}") == b"\x89PNG fake"
    assert fetch(f"DATA:image/png;base64,{payload.replace('=', '%3D')}") == b"\x89PNG fake"


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("data:text/plain,hello", Rule.DATA_URL_NOT_BASE64),
        ("data:image/png;charset=utf-8,abc", Rule.DATA_URL_NOT_BASE64),
        ("data:image/png;base64,not base64!!", Rule.INVALID_BASE64),
        ("data:image/png;base64,abc", Rule.INVALID_BASE64),
        ("data:image/png;base64", Rule.INVALID_URL),
    ],
)
def test_bad_data_urls(url: str, rule: Rule) -> None:
    assert refused(url).rule == rule


def test_data_url_size_limit_applies_to_decoded_bytes() -> None:
    policy = MediaPolicy(max_bytes=10)
    assert fetch("data:a/b;base64," + base64.b64encode(b"x" * 10).decode(), policy) == b"x" * 10
    assert refused("data:a/b;base64," + base64.b64encode(b"x" * 11).decode(), policy).rule == (
        Rule.TOO_LARGE
    )
    huge = "data:a/b;base64," + "A" * 10_000
    assert refused(huge, policy).rule == Rule.TOO_LARGE


# -- file: ----------------------------------------------------------------------------------


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    allowed = tmp_path / "allowed"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "a.bin").write_bytes(b"inside")
    (allowed / "sub" / "b.bin").write_bytes(b"nested")
    (tmp_path / "secret.txt").write_bytes(b"secret")
    (allowed / "escape").symlink_to(tmp_path / "secret.txt")
    (allowed / "escape-dir").symlink_to(tmp_path)
    (allowed / "inner-link").symlink_to(allowed / "a.bin")
    (allowed / "big.bin").write_bytes(b"x" * (LIMIT + 1))
    return allowed


def test_file_inside_the_folder(media_dir: Path) -> None:
    policy = MediaPolicy(allowed_local_path=media_dir, max_bytes=LIMIT)
    assert fetch(f"file://{media_dir}/a.bin", policy) == b"inside"
    assert fetch(f"file:{media_dir}/sub/b.bin", policy) == b"nested"
    assert fetch(f"file://localhost{media_dir}/sub/../a.bin", policy) == b"inside"
    assert fetch(f"file://{media_dir}/inner-link", policy) == b"inside"


@pytest.mark.parametrize(
    "path",
    [
        "{root}/../secret.txt",
        "{root}/sub/../../secret.txt",
        "{root}/%2e%2e/secret.txt",
        "{root}/escape",
        "{root}/escape-dir/secret.txt",
        "/etc/passwd",
        "/nonexistent/file",
        "{root}/../allowed-sibling/x",
    ],
)
def test_file_outside_the_folder(media_dir: Path, path: str) -> None:
    policy = MediaPolicy(allowed_local_path=media_dir)
    url = "file://" + path.format(root=media_dir)
    assert refused(url, policy).rule == Rule.OUTSIDE_LOCAL_PATH


def test_file_urls_disabled_without_a_folder() -> None:
    assert refused("file:///etc/passwd").rule == Rule.LOCAL_FILES_DISABLED


def test_file_url_with_a_remote_host(media_dir: Path) -> None:
    policy = MediaPolicy(allowed_local_path=media_dir)
    assert refused(f"file://evil.test{media_dir}/a.bin", policy).rule == Rule.INVALID_URL


def test_file_missing_or_not_regular_is_422(media_dir: Path) -> None:
    policy = MediaPolicy(allowed_local_path=media_dir)
    for url in [f"file://{media_dir}/missing.bin", f"file://{media_dir}/sub"]:
        with pytest.raises(MediaFetchFailed) as info:
            fetch(url, policy)
        assert info.value.status == 422


def test_file_over_the_limit(media_dir: Path) -> None:
    policy = MediaPolicy(allowed_local_path=media_dir, max_bytes=LIMIT)
    assert refused(f"file://{media_dir}/big.bin", policy).rule == Rule.TOO_LARGE


def test_allowed_local_path_must_exist(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        MediaConnector(MediaPolicy(allowed_local_path=tmp_path / "missing"))


# -- loaders --------------------------------------------------------------------------------


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` with a tiny (truncated) IDAT."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1-bit greyscale
    idat = zlib.compress(b"\x00" * 1024, 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_decompression_bomb_is_refused_from_the_header() -> None:
    bomb = _png_header_only(100_000, 100_000)
    assert len(bomb) < 200
    with pytest.raises(MediaRefused) as info:
        load_image(bomb)
    assert info.value.rule == Rule.IMAGE_TOO_LARGE


def test_per_call_pixel_limit_below_pillows_global_guard() -> None:
    with pytest.raises(MediaRefused) as info:
        load_image(_png_header_only(5_000, 5_000), max_pixels=1_000_000)
    assert info.value.rule == Rule.IMAGE_TOO_LARGE


def test_real_compressed_bomb_is_refused() -> None:
    # 9000 x 9000 black, small as PNG; decoding would need 243 MB as RGB.
    bomb = _png(Image.new("1", (9_000, 9_000)))
    assert len(bomb) < 200_000
    with pytest.raises(MediaRefused) as info:
        load_image(bomb, max_pixels=10_000_000)
    assert info.value.rule == Rule.IMAGE_TOO_LARGE


def test_load_image_gives_rgb_with_white_for_transparency() -> None:
    rgba = Image.new("RGBA", (4, 3), (255, 0, 0, 0))
    rgba.putpixel((0, 0), (0, 0, 255, 255))
    image = load_image(_png(rgba))
    assert image.mode == "RGB" and image.size == (4, 3)
    assert image.getpixel((1, 1)) == (255, 255, 255)
    assert image.getpixel((0, 0)) == (0, 0, 255)
    buffer = io.BytesIO()
    Image.new("L", (2, 2), 7).save(buffer, format="JPEG")
    assert load_image(buffer.getvalue()).mode == "RGB"


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not an image",
        _png(Image.new("RGB", (64, 64), (1, 2, 3)))[:50],
        b"%!PS-Adobe-3.0 EPSF-3.0\n",
    ],
)
def test_invalid_image(data: bytes) -> None:
    with pytest.raises(MediaRefused) as info:
        load_image(data)
    assert info.value.rule == Rule.INVALID_IMAGE
