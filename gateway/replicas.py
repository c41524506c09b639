"""The gateway's replicas: where they are, what they serve, whether they may take new requests,
and the per-replica counts behind the dashboard."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from gateway.circuit import CLOSED, CircuitBreaker
from protocol.features import ENGINE_FEATURES

HEALTHY, UNHEALTHY, DOWN, UNKNOWN = "healthy", "unhealthy", "down", "unknown"


@dataclass(slots=True)
class ReplicaCounts:
    requests: int = 0
    errors: int = 0  # failures before the first byte or mid-stream
    prompt_tokens: int = 0  # of requests whose usage came back
    predicted_cached_tokens: int = 0  # predicted for those same requests
    cached_tokens: int = 0  # engine-reported


@dataclass(slots=True)
class Replica:
    name: str
    url: str
    breaker: CircuitBreaker
    models: list[str] = field(default_factory=list)
    model_cards: list[dict] = field(default_factory=list)  # as the replica's /v1/models
    namespace_model: str | None = None  # the model id the engine builds namespaces from
    health: str = UNKNOWN
    health_detail: str = ""
    draining: bool = False  # set by the admin: finish what runs, take nothing new
    exact: bool = True  # serves /kv/snapshot + /kv/events; False: approximate index
    kv_connected: bool = False
    kv_source: str = "kvgate"  # exact entries from "kvgate" (/kv/events) or "zmq" (--kv-events)
    event_lag_s: float | None = None  # age of the last applied event batch, by its timestamp
    kv_feed: object | None = field(default=None, repr=False)  # a ZMQ feed's counters (FeedStats)
    parity: str = "unchecked"  # "ok", "mismatch: …", "unavailable", "unchecked"
    load: dict = field(default_factory=dict)  # the engine's last report
    role: str = "both"  # P/D role from /kv/snapshot: "both" | "prefill" | "decode"
    kv_transfer_address: str | None = None  # a decode replica's KV receiver
    engine: str | None = None  # configured: "kvgate" | "vllm" | "sglang" | "other"; None: ask it
    advertised: frozenset[str] = frozenset()  # features its model cards list (kvgate replicas)
    counts: ReplicaCounts = field(default_factory=ReplicaCounts)
    # Requests waiting for this replica's first byte; told when the health checks find it down.
    down_waiters: set[asyncio.Future] = field(default_factory=set, repr=False)
    # Streams it is sending; told (with a cause) when it goes down or starts draining.
    stream_watchers: dict[asyncio.Future, frozenset[str]] = field(default_factory=dict, repr=False)

    @property
    def features(self) -> frozenset[str]:
        """What it serves beyond plain generation: as configured for its engine, else as its
        model cards say (a replica that says nothing serves none)."""
        if self.engine is not None:
            return ENGINE_FEATURES.get(self.engine, frozenset())
        return self.advertised

    def supports(self, features: frozenset[str]) -> bool:
        return features <= self.features

    def routable(self) -> bool:
        """May this replica be offered to the policy for a new request?"""
        return self.health == HEALTHY and not self.draining and self.breaker.allow()

    def notify_down(self) -> None:
        """The replica stopped answering: requests still waiting for its first byte give up on it."""
        for waiter in self.down_waiters:
            if not waiter.done():
                waiter.set_result(self.name)
        self.down_waiters.clear()
        self.notify_streams("down")

    def watch_stream(self, causes: frozenset[str] = frozenset({"down", "drain"})) -> asyncio.Future:
        """A future resolved with the cause ("down": the health checks lost it, "drain": it
        stopped taking requests) when one of `causes` happens; give it back with unwatch_stream."""
        watcher = asyncio.get_running_loop().create_future()
        self.stream_watchers[watcher] = causes
        return watcher

    def unwatch_stream(self, watcher: asyncio.Future) -> None:
        self.stream_watchers.pop(watcher, None)

    def notify_streams(self, cause: str) -> None:
        for watcher, causes in list(self.stream_watchers.items()):
            if cause in causes:
                del self.stream_watchers[watcher]
                if not watcher.done():
                    watcher.set_result(cause)

    @property
    def index_mode(self) -> str:
        """What the dashboard shows: exact (kvgate), exact (zmq) or approximate."""
        return f"exact ({self.kv_source})" if self.exact else "approximate"

    @property
    def status(self) -> str:
        if self.draining:
            return "draining"
        if self.health == HEALTHY and self.breaker.state != CLOSED:
            return f"circuit_{self.breaker.state}"
        return self.health


def serving(replicas: Iterable[Replica], model: str) -> list[Replica]:
    """The replicas that serve `model`, whatever their health."""
    return [r for r in replicas if model in r.models]


def role_exclusions(replicas: list[Replica], model: str, tried: set[str] = frozenset()) -> set[str]:
    """Replicas kept out of whole (colocated) requests: with roles in the fleet, a request that
    does not go through a prefill/decode pair goes to a `both` replica, else to a decode
    replica (it can prefill), and to a prefill replica only when nothing else is left."""
    serving = [r for r in replicas if model in r.models and r.routable() and r.name not in tried]
    for allowed in (("both",), ("both", "decode")):
        if any(r.role in allowed for r in serving):
            return {r.name for r in replicas if r.role not in allowed}
    return set()


def replica_name(url: str, taken: set[str]) -> str:
    """A short stable name from the URL's host:port, unique among `taken`."""
    base = url.split("://", 1)[-1].rstrip("/").split("/", 1)[0]
    name, i = base, 2
    while name in taken:
        name, i = f"{base}#{i}", i + 1
    return name
