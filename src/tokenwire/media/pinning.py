"""An httpx transport that can only connect to addresses the connector has vetted.

Why not put the IP in the URL and set ``Host``? Then https connections are pooled by IP and a
connection verified for one hostname could be reused for another. Here the URL keeps the real
hostname, so pooling, ``Host``, TLS SNI and certificate verification all use the hostname, while
the network backend never resolves names: it connects to the addresses pinned for that hostname
by the connector for the duration of the request, and refuses any host with no pin. A DNS answer
that changes between the check and the connect (DNS rebinding) therefore has no effect.
"""

from __future__ import annotations

import functools
import ssl
import typing
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import contextmanager

import httpcore
import httpx

# httpcore exception -> httpx exception, most specific first (httpx's own transport maps the same).
_EXCEPTIONS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
)


@contextmanager
def _httpx_errors() -> Iterator[None]:
    try:
        yield
    except httpx.TransportError:
        raise
    except Exception as exc:
        for core_type, httpx_type in _EXCEPTIONS:
            if isinstance(exc, core_type):
                raise httpx_type(str(exc)) from exc
        raise


class PinTable:
    """hostname -> vetted addresses, held only while a request for that host is in flight."""

    def __init__(self) -> None:
        self._pins: dict[str, tuple[tuple[str, ...], int]] = {}

    @contextmanager
    def pinned(self, host: str, addresses: Sequence[str]) -> Iterator[None]:
        """Pin ``host`` to ``addresses`` (all already vetted) inside the block.

        Concurrent requests for one host may pin different answers; the latest wins, which is
        safe because every pinned address passed the same checks.
        """
        if not addresses:
            raise ValueError("no addresses to pin")
        _, count = self._pins.get(host, ((), 0))
        self._pins[host] = (tuple(addresses), count + 1)
        try:
            yield
        finally:
            current, count = self._pins[host]
            if count <= 1:
                del self._pins[host]
            else:
                self._pins[host] = (current, count - 1)

    def lookup(self, host: str) -> tuple[str, ...]:
        entry = self._pins.get(host)
        return () if entry is None else entry[0]


class PinnedNetworkBackend(httpcore.AsyncNetworkBackend):
    """Connects to the pinned addresses of a host, in order; never resolves a name itself."""

    def __init__(self, pins: PinTable, inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self._pins = pins
        self._inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        addresses = self._pins.lookup(host)
        if not addresses:
            raise httpcore.ConnectError(f"no vetted address pinned for {host!r}")
        last_error: Exception | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address, port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last_error = exc
        assert last_error is not None
        raise last_error

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not used for media")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, stream: typing.AsyncIterable[bytes]) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _httpx_errors():
            async for chunk in self._stream:
                yield chunk

    async def aclose(self) -> None:
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            with _httpx_errors():
                await aclose()


@functools.cache
def default_ssl_context() -> ssl.SSLContext:
    """httpx's default (certifi CAs, hostname checks); built once, loading the CAs is slow."""
    return httpx.create_ssl_context()


class PinnedTransport(httpx.AsyncBaseTransport):
    """httpx's default transport, but over ``PinnedNetworkBackend``; no proxies, HTTP/1.1."""

    def __init__(self, pins: PinTable, ssl_context: ssl.SSLContext | None = None) -> None:
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context or default_ssl_context(),
            max_connections=100,
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
            network_backend=PinnedNetworkBackend(pins),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _httpx_errors():
            response = await self._pool.handle_async_request(core_request)
        assert isinstance(response.stream, typing.AsyncIterable)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_ResponseStream(response.stream),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._pool.aclose()
