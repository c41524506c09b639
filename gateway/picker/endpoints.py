"""A replica's address as the proxy needs it: "ip:port". Envoy's `override_host` load balancer
matches the header's addresses against its cluster's endpoints and resolves no names, so a
replica configured by host name (a Kubernetes pod's DNS name) is resolved here, and the answer
kept for a few seconds."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from urllib.parse import urlsplit

RESOLVE_TTL_S = 5.0


class UnresolvableReplica(OSError):
    """The replica's host name has no address now."""


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.hostname is None:
        raise ValueError(f"replica URL {url!r} has no host")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def format_endpoint(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class Endpoints:
    def __init__(self, ttl_s: float = RESOLVE_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._resolved: dict[str, tuple[float, str]] = {}  # url -> (expiry, endpoint)

    async def of(self, url: str) -> str:
        """The replica's "ip:port"; raises UnresolvableReplica."""
        cached = self._resolved.get(url)
        now = time.monotonic()
        if cached is not None and cached[0] > now:
            return cached[1]
        host, port = host_port(url)
        try:
            ipaddress.ip_address(host)
            ip = host
        except ValueError:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise UnresolvableReplica(f"cannot resolve {host}: {exc}") from exc
            ip = infos[0][4][0]
        endpoint = format_endpoint(ip, port)
        self._resolved[url] = (now + self.ttl_s, endpoint)
        return endpoint

    def known(self, url: str) -> str | None:
        """The last address found for the replica, without looking it up."""
        cached = self._resolved.get(url)
        return cached[1] if cached is not None else None
