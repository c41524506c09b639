"""Baseline: the same session (an affinity header value) always to the same replica, by
rendezvous hashing so adding a replica moves only its share; no key -> least load."""

from __future__ import annotations

import random

from routing.policies.base import (Decision, ReplicaState, RouteRequest, build_decision, home_of,
                                   pick_min, require_replicas)


class SessionAffinityPolicy:
    name = "session_affinity"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, replicas: list[ReplicaState]) -> Decision:
        require_replicas(replicas)
        if request.session_key is None:
            chosen = pick_min(replicas, lambda r: r.in_flight, self._rng)
            return build_decision(self.name, request, chosen, "no_session_key", replicas)
        chosen = home_of(request.session_key, replicas)
        return build_decision(self.name, request, chosen, "session", replicas)
