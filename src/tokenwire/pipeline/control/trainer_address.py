"""Which trainer addresses a weight-transfer init may make this server dial.

An init names ``master_address`` and ``master_port``, and the server connects there: without a
rule, whoever holds the control key could make it probe any host it reaches (a cloud metadata
service, the private network). The address is resolved once, checked, and the checked address
is what the join dials (no second lookup to rebind). Allowed: loopback always; then the
networks and hosts of ``--weight-transfer-allowed-hosts``, or by default the private ranges a
training cluster lives on. Link-local addresses (the metadata services sit at 169.254.169.254
and fd00:ec2::254), multicast, unspecified and reserved ones never, nor a port below 1024 (a
system service's, never a trainer's rendezvous).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from tokenwire.pipeline.errors import InvalidRequest

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# The private ranges of RFC 1918 and RFC 4193: where a trainer beside its servers lives.
PRIVATE_NETWORKS: tuple[Network, ...] = tuple(
    ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")
)
# Never dialled, whatever the flag says: AWS's IPv6 metadata address lies in fc00::/7.
_METADATA = (ipaddress.ip_address("fd00:ec2::254"),)
_FIRST_USER_PORT = 1024


@dataclass(frozen=True, slots=True)
class TrainerAddressPolicy:
    """``--weight-transfer-allowed-hosts``: networks (``10.1.0.0/16``, ``10.1.2.3``) and host
    names (matched as given, before resolution); None: the private ranges."""

    networks: tuple[Network, ...] | None = None
    hosts: frozenset[str] = frozenset()

    @classmethod
    def from_flag(cls, entries: tuple[str, ...] | None) -> TrainerAddressPolicy:
        """``ValueError`` naming an entry that is neither a network nor a host name."""
        if entries is None:
            return cls()
        networks: list[Network] = []
        hosts: set[str] = set()
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if not entry or any(c.isspace() or c in "/:" for c in entry):
                    raise ValueError(f"{entry!r} is neither a network nor a host name") from None
                hosts.add(entry.lower())
        return cls(tuple(networks), frozenset(hosts))

    def resolve(self, host: str, port: int) -> str:
        """The address to dial for ``host``: a 400 unless every address it resolves to is
        allowed, and the port too. Blocking (a name lookup); run it off the event loop."""
        if port < _FIRST_USER_PORT:
            raise InvalidRequest(
                f"master_port {port}: ports below {_FIRST_USER_PORT} belong to system services, "
                "never a trainer's rendezvous",
                "init_info.master_port",
            )
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError) as exc:
            raise InvalidRequest(
                f"master_address {host!r} does not resolve", "init_info.master_address"
            ) from exc
        addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
        named = host.lower() in self.hosts
        for address in addresses:
            why = self._refusal(address, named=named)
            if why is not None:
                raise InvalidRequest(
                    f"master_address {host!r} ({address}) is not a trainer address this server "
                    f"dials: {why} (--weight-transfer-allowed-hosts)",
                    "init_info.master_address",
                )
        return str(addresses[0])

    def _refusal(self, address: Address, *, named: bool) -> str | None:
        mapped = getattr(address, "ipv4_mapped", None)
        if mapped is not None:
            address = mapped
        if address.is_loopback:
            return None
        if address.is_link_local or address in _METADATA:
            return "link-local and metadata addresses are never dialled"
        if address.is_multicast or address.is_unspecified or address.is_reserved:
            return "not a host address"
        if named:
            return None
        networks = PRIVATE_NETWORKS if self.networks is None else self.networks
        if any(address in network for network in networks):
            return None
        return "outside the allowed networks" + (
            " (by default loopback and the private ranges)" if self.networks is None else ""
        )
