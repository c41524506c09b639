"""The one small interface every routing policy implements, and the data it sees."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import xxhash


@dataclass(slots=True)
class RouteRequest:
    request_id: str
    hashes: Sequence[int]  # canonical block hashes of the prompt (full blocks only)
    prompt_tokens: int
    block_size: int = 16
    session_key: str | None = None  # the client's routing hint (session header, prompt_cache_key)
    priority: int = 0  # lower is more urgent; the load it sees is that of priority <= this


@dataclass(slots=True)
class ReplicaState:
    """What a policy knows about one routable replica for one request."""

    name: str
    cached_tokens: int = 0  # predicted longest cached prefix, in tokens
    in_flight: int = 0
    pending_prefill_tokens: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    approximate: bool = False  # cache knowledge learned from routing history, not events
    tier_tokens: int = 0  # past cached_tokens: prefix tokens its KV tier holds (restorable)
    restore_cost: float = 0.1  # restoring a tier token, as a share of prefilling it


@dataclass(slots=True)
class ReplicaScore:
    """One row of a decision's explanation."""

    replica: str
    cached_tokens: int
    in_flight: int
    pending_prefill_tokens: int
    kv_usage: float
    cost: float | None = None
    excluded: str | None = None  # why the replica was not a candidate


@dataclass(slots=True)
class Decision:
    replica: str
    reason: str
    policy: str
    scores: list[ReplicaScore] = field(default_factory=list)
    request_id: str = ""
    cached_tokens: int = 0  # predicted cached tokens on the chosen replica

    def score_of(self, replica: str) -> ReplicaScore:
        return next(s for s in self.scores if s.replica == replica)


class NoReplicaAvailable(RuntimeError):
    """No healthy replica can take the request."""


class Policy(Protocol):
    name: str

    def choose(self, request: RouteRequest, replicas: list[ReplicaState]) -> Decision: ...


def explain(replicas: Sequence[ReplicaState], costs: dict[str, float] | None = None,
            excluded: dict[str, str] | None = None) -> list[ReplicaScore]:
    costs = costs or {}
    excluded = excluded or {}
    return [
        ReplicaScore(r.name, r.cached_tokens, r.in_flight, r.pending_prefill_tokens, r.kv_usage,
                     costs.get(r.name), excluded.get(r.name))
        for r in replicas
    ]


def require_replicas(replicas: Sequence[ReplicaState]) -> None:
    if not replicas:
        raise NoReplicaAvailable("no healthy replica")


def rendezvous_weight(key: str, replica: str) -> int:
    """Rendezvous (highest random weight) hashing: the replica with the largest weight is the
    key's home, the same for every gateway, and adding a replica moves only its share of keys.
    52 bits, so the weight survives a Lua number (a double) unchanged."""
    return xxhash.xxh3_64_intdigest(f"{key}\x00{replica}".encode()) >> 12


def home_of(key: str, items: Sequence[ReplicaState]) -> ReplicaState:
    """The key's home among `items` (by rendezvous weight)."""
    return max(items, key=lambda r: rendezvous_weight(key, r.name))


def pick_min(items: Sequence[ReplicaState], key, rng: random.Random) -> ReplicaState:
    """The item with the smallest key; ties broken at random, never by position."""
    best = min(key(r) for r in items)
    return rng.choice([r for r in items if key(r) == best])


def build_decision(policy: str, request: RouteRequest, chosen: ReplicaState, reason: str,
                   replicas: Sequence[ReplicaState], costs: dict[str, float] | None = None,
                   excluded: dict[str, str] | None = None) -> Decision:
    return Decision(chosen.name, reason, policy, explain(replicas, costs, excluded),
                    request.request_id, chosen.cached_tokens)
