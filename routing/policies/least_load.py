"""Baseline: the replica with the fewest requests in flight (then least pending prefill)."""

from __future__ import annotations

import random

from routing.policies.base import (Decision, ReplicaState, RouteRequest, build_decision, pick_min,
                                   require_replicas)


class LeastLoadPolicy:
    name = "least_load"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, replicas: list[ReplicaState]) -> Decision:
        require_replicas(replicas)
        chosen = pick_min(replicas, lambda r: (r.in_flight, r.pending_prefill_tokens), self._rng)
        return build_decision(self.name, request, chosen, "least_load", replicas)
