"""What the media connector may fetch: the settings object and the address rules.

Kept apart from the connector so the rules can be read (and tested) without any networking.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_REDIRECTS = 5

DEFAULT_MAX_IMAGES_PER_REQUEST = 8
# Decoding costs memory per pixel before the processor shrinks an image to the model's size
# (about 14 bytes a pixel measured): 48 Mi pixels, e.g. four 12-megapixel photos, peak at about
# 0.65 GiB for one request (bench/bench_media_limits.py).
DEFAULT_MAX_IMAGE_PIXELS_PER_REQUEST = 48 * 2**20

# NAT64 well-known prefix: 64:ff9b::a.b.c.d reaches a.b.c.d through a translator.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


@dataclass(frozen=True)
class MediaPolicy:
    """Media fetching settings, read once from the ``--*media*`` flags.

    ``allowed_domains`` is an exact, case-insensitive host match (``None``: any host);
    ``max_bytes`` bounds the fetched body; ``timeout_s`` is both the connect/read timeout and
    the deadline for the whole fetch, redirects included. The per-request limits bound one
    request's media: ``max_images_per_request`` counts its images (cached or not) and
    ``max_image_pixels_per_request`` the pixels of the images it makes the server decode (read
    from the image headers before any pixel is decoded; cached images cost nothing).
    """

    allowed_domains: frozenset[str] | None = None
    allow_private_networks: bool = False
    allow_redirects: bool = False
    max_bytes: int = 20 * 2**20
    timeout_s: float = 10.0
    allowed_local_path: Path | None = None
    max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST
    max_image_pixels_per_request: int = DEFAULT_MAX_IMAGE_PIXELS_PER_REQUEST

    def __post_init__(self) -> None:
        for name in (
            "max_bytes",
            "timeout_s",
            "max_images_per_request",
            "max_image_pixels_per_request",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.allowed_domains is not None:
            # Accept any iterable (settings hold a tuple); compare in the form URLs parse to.
            domains = frozenset(normalize_host(d) for d in _as_iterable(self.allowed_domains))
            object.__setattr__(self, "allowed_domains", domains)
        if self.allowed_local_path is not None:
            object.__setattr__(self, "allowed_local_path", Path(self.allowed_local_path))

    def host_allowed(self, host: str) -> bool:
        """Exact match against the allow-list; ``host`` as ``normalize_host`` returns it."""
        return self.allowed_domains is None or host in self.allowed_domains


def _as_iterable(value: Iterable[str] | str) -> Iterable[str]:
    return [value] if isinstance(value, str) else value


def normalize_host(host: str) -> str:
    """Lower-case ASCII (IDNA) form, the same form ``url_host`` gives for a URL's host."""
    host = host.strip()
    if not host:
        raise ValueError("empty media domain")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        pass
    try:
        return url_host(httpx.URL(f"http://{host}/"))
    except httpx.InvalidURL as exc:
        raise ValueError(f"invalid media domain {host!r}") from exc


def url_host(url: httpx.URL) -> str:
    """The host an http(s) URL names, as lower-case ASCII (IDNA-encoded, IPv6 unbracketed)."""
    return url.raw_host.decode("ascii").lower()


def is_public_address(ip: IPAddress) -> bool:
    """True only for globally routable unicast addresses.

    Strict on purpose: private, loopback, link-local, multicast, reserved, unspecified,
    site-local, CGNAT (100.64/10), unique-local (fc00::/7), documentation and benchmark ranges are
    all refused, and IPv6 forms that embed an IPv4 address (mapped, 6to4, Teredo, NAT64) are judged
    by the embedded address as well.
    """
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id:
            return False
        if ip.ipv4_mapped is not None:
            return is_public_address(ip.ipv4_mapped)
        embedded: list[ipaddress.IPv4Address] = []
        if ip.sixtofour is not None:
            embedded.append(ip.sixtofour)
        if ip.teredo is not None:
            embedded.extend(ip.teredo)
        if ip in _NAT64:
            embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if not all(is_public_address(v4) for v4 in embedded):
            return False
        if ip.is_site_local:
            return False
        if ip in _NAT64:
            return True  # only reserved because of ::/8; the embedded address was checked
    return (
        ip.is_global
        and not ip.is_private
        and not ip.is_multicast
        and not ip.is_reserved
        and not ip.is_loopback
        and not ip.is_link_local
        and not ip.is_unspecified
    )
