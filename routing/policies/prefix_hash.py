"""Baseline: consistent hash of the prompt's first blocks onto a ring of replicas, with a load
bound (skip a replica above 1.25 x mean in-flight), as SGLang's `prefix_hash`."""

from __future__ import annotations

import bisect

import xxhash

from routing.policies.base import (Decision, ReplicaState, RouteRequest, build_decision,
                                   require_replicas)

VIRTUAL_NODES = 64


class PrefixHashPolicy:
    name = "prefix_hash"

    def __init__(self, seed: int | None = None, prefix_blocks: int = 16,
                 load_factor: float = 1.25) -> None:
        self.prefix_blocks = prefix_blocks
        self.load_factor = load_factor
        self._ring_for: tuple[str, ...] = ()
        self._ring: list[tuple[int, str]] = []

    def _ring_of(self, names: tuple[str, ...]) -> list[tuple[int, str]]:
        if names != self._ring_for:
            self._ring = sorted((xxhash.xxh3_64_intdigest(f"{n}#{v}".encode()), n)
                                for n in names for v in range(VIRTUAL_NODES))
            self._ring_for = names
        return self._ring

    def choose(self, request: RouteRequest, replicas: list[ReplicaState]) -> Decision:
        require_replicas(replicas)
        by_name = {r.name: r for r in replicas}
        ring = self._ring_of(tuple(sorted(by_name)))
        n = min(len(request.hashes), self.prefix_blocks)
        key = request.hashes[n - 1] if n else xxhash.xxh3_64_intdigest(request.request_id.encode())
        bound = self.load_factor * (sum(r.in_flight for r in replicas) / len(replicas)) + 1
        start = bisect.bisect_left(ring, (key, ""))
        reason = "ring"
        for step in range(len(ring)):
            name = ring[(start + step) % len(ring)][1]
            if by_name[name].in_flight <= bound:
                break
            reason = "ring_load_bound"
        return build_decision(self.name, request, by_name[name], reason, replicas)
