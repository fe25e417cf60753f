"""The one guarded media connector: every media URL the server fetches goes through ``fetch``.

Order of checks for http(s): scheme -> URL shape -> host allow-list -> resolve (ourselves) ->
every resolved address vetted -> connect to a vetted address only (pinned, see ``pinning``) ->
status (redirects re-enter the loop, re-checked) -> identity coding only -> size before and
while reading. One deadline bounds the whole fetch. ``data:`` (base64 only) and ``file:`` (only
under the allowed folder) never touch the network.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import ipaddress
import logging
import os
import socket
import ssl
import stat
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

from tokenwire.media.errors import MediaError, MediaFetchFailed, MediaRefused, Rule
from tokenwire.media.pinning import PinnedTransport, PinTable
from tokenwire.media.policy import MAX_REDIRECTS, MediaPolicy, is_public_address, url_host

__all__ = ["MediaConnector", "MediaError", "MediaFetchFailed", "MediaPolicy", "MediaRefused"]

logger = logging.getLogger("tokenwire.media")

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""(host, port) -> IP address strings; the seam tests use to fake DNS."""

_USER_AGENT = "tokenwire-media/0.1"


# Distinct lookups that may wait on DNS at once; one more fails at once rather than queueing.
MAX_DNS_LOOKUPS = 64


class SystemResolver:
    """The system resolver (hosts file, DNS; also normalises ``2130706433``, ``0x7f.1``), each
    lookup on a thread of its own.

    Not on the event loop's default executor, as ``loop.getaddrinfo`` runs it: a few names whose
    DNS never answers would fill that small pool, and every other client's lookups, image
    decodes and renders would queue behind them. Here a lookup that hangs holds only its own
    thread until the system gives up; each fetch stops waiting at its own deadline, and
    concurrent fetches of one name share one lookup.
    """

    def __init__(self, max_lookups: int = MAX_DNS_LOOKUPS) -> None:
        self._max_lookups = max_lookups
        self._pending: dict[tuple[str, int], asyncio.Future[list[str]]] = {}

    async def __call__(self, host: str, port: int) -> list[str]:
        key = (host, port)
        future = self._pending.get(key)
        if future is None:
            if len(self._pending) >= self._max_lookups:
                raise OSError(f"{self._max_lookups} DNS lookups are already in flight")
            loop = asyncio.get_running_loop()
            future = self._pending[key] = loop.create_future()
            future.add_done_callback(lambda _: self._forget(key))
            threading.Thread(
                target=_lookup, args=(loop, future, host, port), name="dns", daemon=True
            ).start()
        # Shielded: one caller reaching its deadline must not cancel the others' lookup.
        return list(await asyncio.shield(future))

    def _forget(self, key: tuple[str, int]) -> None:
        future = self._pending.pop(key)
        future.exception()  # retrieved here: every caller may have left at its deadline


def _lookup(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[list[str]], host: str, port: int
) -> None:
    """Runs on its own thread: resolve, then hand the answer (or error) to ``future``."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except Exception as exc:
        _settle(loop, future, exc)
        return
    addresses: list[str] = []
    for _family, _type, _proto, _canon, sockaddr in infos:
        address = str(sockaddr[0])
        if address not in addresses:
            addresses.append(address)
    _settle(loop, future, addresses)


def _settle(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[list[str]],
    outcome: list[str] | Exception,
) -> None:
    def settle() -> None:
        if future.done():
            return
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    with contextlib.suppress(RuntimeError):  # the loop closed while DNS was slow
        loop.call_soon_threadsafe(settle)


class MediaConnector:
    """Fetches media bytes under a ``MediaPolicy``; built once at start-up, shared by routes."""

    def __init__(
        self,
        policy: MediaPolicy,
        *,
        resolver: Resolver | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.policy = policy
        self._resolve = resolver or SystemResolver()
        self._local_root: Path | None = None
        if policy.allowed_local_path is not None:
            root = policy.allowed_local_path.resolve(strict=True)
            if not root.is_dir():
                raise ValueError(f"--allowed-local-media-path {root} is not a directory")
            self._local_root = root
        if policy.allowed_domains is None:
            logger.warning(
                "--allowed-media-domains is not set: media URLs may name any public host"
            )
        self._pins = PinTable()
        self._client = httpx.AsyncClient(
            transport=PinnedTransport(self._pins, ssl_context),
            trust_env=False,
            follow_redirects=False,
            timeout=httpx.Timeout(policy.timeout_s),
            headers={"User-Agent": _USER_AGENT, "Accept-Encoding": "identity"},
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def fetch(self, url: str) -> bytes:
        """The bytes ``url`` names, or a ``MediaError`` (400 refusal / 422 or 400 failure)."""
        scheme, sep, _ = url.partition(":")
        scheme = scheme.lower()
        if not sep or scheme not in ("http", "https", "data", "file"):
            raise MediaRefused(Rule.UNSUPPORTED_SCHEME, "use http, https, data or file")
        if scheme == "data":
            return self._decode_data_url(url)
        if scheme == "file":
            return await self._read_local_file(url)
        try:
            async with asyncio.timeout(self.policy.timeout_s):
                return await self._fetch_http(url)
        except TimeoutError:
            raise MediaRefused(
                Rule.TIMED_OUT, f"no complete response within {self.policy.timeout_s:g} s"
            ) from None

    # -- http(s) ------------------------------------------------------------------------------

    async def _fetch_http(self, url: str) -> bytes:
        current = self._parse_http_url(url)
        for hop in range(MAX_REDIRECTS + 1):
            host = url_host(current)
            addresses = await self._vetted_addresses(current)
            with self._pins.pinned(host, addresses):
                try:
                    async with self._client.stream("GET", current) as response:
                        if not response.is_redirect:  # any 3xx, with or without Location
                            return await self._read_body(response)
                        location = response.headers.get("location")
                        if location is None:
                            raise MediaRefused(
                                Rule.REDIRECT_WITHOUT_LOCATION,
                                f"media host answered {response.status_code}",
                            )
                except httpx.InvalidURL:
                    # httpx parses Location itself even with follow_redirects=False.
                    if not self.policy.allow_redirects:
                        raise MediaRefused(Rule.REDIRECTS_NOT_ALLOWED) from None
                    raise MediaRefused(Rule.INVALID_URL, "bad redirect Location") from None
                except httpx.TimeoutException:
                    raise MediaRefused(Rule.TIMED_OUT) from None
                except httpx.ConnectError as exc:
                    message = f"could not connect to media host {host}: {exc}"
                    raise MediaFetchFailed(message) from None
                except httpx.HTTPError as exc:
                    name = type(exc).__name__
                    raise MediaFetchFailed(f"media fetch from {host} failed ({name})") from None
            if not self.policy.allow_redirects:
                raise MediaRefused(Rule.REDIRECTS_NOT_ALLOWED, "set --media-allow-redirects")
            if hop == MAX_REDIRECTS:
                break
            try:
                target = current.join(location)
            except httpx.InvalidURL:
                raise MediaRefused(Rule.INVALID_URL, "bad redirect Location") from None
            current = self._parse_http_url(str(target))
        raise MediaRefused(Rule.TOO_MANY_REDIRECTS, f"more than {MAX_REDIRECTS}")

    def _parse_http_url(self, url: str) -> httpx.URL:
        """Shape and allow-list checks; used for the first URL and for every redirect target."""
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, ValueError, TypeError):
            raise MediaRefused(Rule.INVALID_URL) from None
        if parsed.scheme not in ("http", "https"):
            raise MediaRefused(Rule.UNSUPPORTED_SCHEME, "redirects may only go to http or https")
        if not parsed.raw_host:
            raise MediaRefused(Rule.INVALID_URL, "no host")
        if parsed.userinfo:
            raise MediaRefused(Rule.CREDENTIALS_IN_URL)
        host = url_host(parsed)
        if not self.policy.host_allowed(host):
            raise MediaRefused(Rule.DOMAIN_NOT_ALLOWED, host)
        return parsed.copy_with(fragment=None)

    async def _vetted_addresses(self, url: httpx.URL) -> list[str]:
        """Resolve the host and refuse if ANY answer is non-public (unless private is allowed)."""
        host = url_host(url)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            addresses = [ipaddress.ip_address(host).compressed]
        except ValueError:
            try:
                addresses = list(await self._resolve(host, port))
            except (OSError, UnicodeError) as exc:
                raise MediaFetchFailed(f"could not resolve media host {host}: {exc}") from None
        if not addresses:
            raise MediaFetchFailed(f"could not resolve media host {host}")
        if not self.policy.allow_private_networks:
            for address in addresses:
                try:
                    public = is_public_address(ipaddress.ip_address(address))
                except ValueError:
                    public = False
                if not public:
                    raise MediaRefused(
                        Rule.PRIVATE_ADDRESS,
                        f"{host} is or resolves to a private, loopback, link-local, multicast or "
                        "reserved address (set --allow-private-media-networks to allow)",
                    )
        return addresses

    async def _read_body(self, response: httpx.Response) -> bytes:
        status = response.status_code
        if 400 <= status < 500:
            raise MediaFetchFailed(
                f"media host answered {status}", status=422, remote_status=status
            )
        if not 200 <= status < 300:
            raise MediaFetchFailed(f"media host answered {status}", remote_status=status)
        # We ask for identity; a compressed body would be decoded past the size limit (a gzip
        # bomb), so any other coding is refused, and the raw stream is read without decoders.
        encoding = response.headers.get("content-encoding", "")
        if any(c.strip().lower() not in ("", "identity") for c in encoding.split(",")):
            raise MediaRefused(Rule.ENCODED_BODY, f"Content-Encoding {encoding!r}")
        limit = self.policy.max_bytes
        declared = response.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise MediaRefused(Rule.TOO_LARGE, f"Content-Length {int(declared)} > {limit} bytes")
        body = bytearray()
        async for chunk in response.aiter_raw():
            if len(body) + len(chunk) > limit:
                raise MediaRefused(Rule.TOO_LARGE, f"more than {limit} bytes")
            body += chunk
        return bytes(body)

    # -- data: --------------------------------------------------------------------------------

    def _decode_data_url(self, url: str) -> bytes:
        header, sep, payload = url[len("data:") :].partition(",")
        if not sep:
            raise MediaRefused(Rule.INVALID_URL, "data URL without ','")
        if header.rsplit(";", 1)[-1].strip().lower() != "base64":
            raise MediaRefused(Rule.DATA_URL_NOT_BASE64, "use data:<mime>;base64,<payload>")
        limit = self.policy.max_bytes
        # Refuse by the encoded length first so a huge payload is never decoded.
        if len(payload) > (limit + 2) // 3 * 4 + 256:
            raise MediaRefused(Rule.TOO_LARGE, f"more than {limit} bytes")
        if "%" in payload:
            payload = unquote(payload)
        try:
            data = base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError):
            raise MediaRefused(Rule.INVALID_BASE64) from None
        if len(data) > limit:
            raise MediaRefused(Rule.TOO_LARGE, f"more than {limit} bytes")
        return data

    # -- file: --------------------------------------------------------------------------------

    async def _read_local_file(self, url: str) -> bytes:
        if self._local_root is None:
            raise MediaRefused(Rule.LOCAL_FILES_DISABLED, "set --allowed-local-media-path")
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaRefused(Rule.INVALID_URL, "file URL host must be empty or localhost")
        raw_path = unquote(parts.path)
        if not raw_path.startswith("/") or "\x00" in raw_path:
            raise MediaRefused(Rule.INVALID_URL, "file URL needs an absolute path")
        # Resolve (following symlinks) before checking; non-strict so that a missing file outside
        # the folder is refused as outside, never reported as missing (no existence oracle).
        path = Path(raw_path).resolve(strict=False)
        if not path.is_relative_to(self._local_root):
            raise MediaRefused(Rule.OUTSIDE_LOCAL_PATH)
        return await asyncio.to_thread(self._read_file, path)

    def _read_file(self, path: Path) -> bytes:
        """Regular files only; a final symlink swapped in after the check is not followed."""
        limit = self.policy.max_bytes
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
        except OSError:
            raise MediaFetchFailed("local media file not found", status=422) from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise MediaFetchFailed("local media file not found", status=422)
        with os.fdopen(fd, "rb") as file:
            if info.st_size > limit:
                raise MediaRefused(Rule.TOO_LARGE, f"more than {limit} bytes")
            data = file.read(limit + 1)
        if len(data) > limit:
            raise MediaRefused(Rule.TOO_LARGE, f"more than {limit} bytes")
        return data
