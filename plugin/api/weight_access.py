"""Who may call the weight routes: the admin key, or (opt-in) a trusted source network.

The key comes in the `triton-admin-key` header (or as `Authorization: Bearer` when the API has no
key of its own) and goes on to the generate model, which checks it and limits wrong keys per client
address. Trainers whose clients send no header at all (AReaL, SkyRL) can be let in by source
network instead: `TRITON_API_TRUSTED_NETWORKS` (CIDRs, none by default) names them, and a keyless
call from there is sent with the API's own copy of the admin key. The client address is the TCP
peer, or, when the peer is a proxy named in `TRITON_API_FORWARDED_ALLOW_IPS` (the front door on
loopback), the last address that proxy wrote into X-Forwarded-For (uvicorn's ProxyHeadersMiddleware
decides it before any route runs).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from fastapi import Request

from ..sampling.admin import ADMIN_HEADER

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(text: str) -> tuple[Network, ...]:
    """Comma- or space-separated CIDRs (a bare address is a /32 or /128); ValueError naming a bad one."""
    networks = []
    for item in text.replace(",", " ").split():
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"{item!r} is not an IP network (e.g. 10.0.0.0/8 or 127.0.0.1)") from None
    return tuple(networks)


@dataclass(frozen=True)
class WeightAccess:
    """The API's weight-route credentials: its API key (None: open), its copy of the admin key
    (None: keyless calls are refused everywhere) and the networks trusted without a key."""

    api_key: str | None = None
    admin_key: str | None = None
    trusted_networks: tuple[Network, ...] = ()

    def client_address(self, raw: Request) -> str:
        """The client's address as the API sees it ("" when unknown)."""
        return raw.client.host if raw.client else ""

    def is_trusted(self, address: str) -> bool:
        """Whether `address` lies in a trusted network."""
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in network for network in self.trusted_networks)

    def sent_key(self, raw: Request) -> str | None:
        """The admin key the request carries (None when it carries none)."""
        key = raw.headers.get(ADMIN_HEADER)
        if key is None and not self.api_key:
            scheme, _, token = raw.headers.get("authorization", "").partition(" ")
            key = token.strip() if scheme.lower() == "bearer" and token.strip() else None
        return key

    def key_for(self, raw: Request) -> str | None:
        """The key to send on: the request's own, else the API's for a trusted network, else None."""
        key = self.sent_key(raw)
        if key is None and self.admin_key and self.is_trusted(self.client_address(raw)):
            return self.admin_key
        return key
