"""One health probe per child: HTTP `GET /health` for replicas and gateways (Envoy: its admin
`/ready`), PING for Redis."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass

from kvgate.launcher.plan import REDIS, ChildSpec

PROBE_TIMEOUT_S = 2.0


@dataclass(slots=True)
class Probe:
    healthy: bool
    status: str  # what to show while waiting: "starting", "loading", "ready", ...


def probe(spec: ChildSpec) -> Probe:
    return _probe_redis(spec) if spec.role == REDIS else _probe_http(spec.health_url or spec.url + "/health")


def _probe_http(url: str) -> Probe:
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as resp:
            return Probe(True, _status_of(resp.read(), "ready"))
    except urllib.error.HTTPError as exc:  # 503 while loading or draining, with a reason
        return Probe(False, _status_of(_body_of(exc), f"HTTP {exc.code}"))
    except (OSError, ValueError):  # not listening yet, or too busy to answer in time
        return Probe(False, "starting")


def _body_of(exc: urllib.error.HTTPError) -> bytes:
    """The error's body; empty where a busy child sent the status line but not the body in
    time (the read times out: a probe says "not ready", never raises)."""
    try:
        return exc.read()
    except OSError:
        return b""


def _status_of(body: bytes, fallback: str) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return fallback
    return str(data.get("status", fallback)) if isinstance(data, dict) else fallback


def _probe_redis(spec: ChildSpec) -> Probe:
    try:
        with socket.create_connection(("127.0.0.1", spec.port), timeout=PROBE_TIMEOUT_S) as s:
            s.sendall(b"PING\r\n")
            ok = s.recv(64).startswith(b"+PONG")
    except OSError:
        return Probe(False, "starting")
    return Probe(ok, "ready" if ok else "not answering PING")


def served_model(base_url: str, fallback: str, api_key: str | None = None) -> str:
    """The first model id a server lists, for the example request."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        request = urllib.request.Request(base_url + "/models", headers=headers)
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S) as resp:
            return str(json.loads(resp.read())["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return fallback
