"""Baseline: each request to the next replica in turn, blind to cache and load."""

from __future__ import annotations

from routing.policies.base import (Decision, ReplicaState, RouteRequest, build_decision,
                                   require_replicas)


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self, seed: int | None = None) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, replicas: list[ReplicaState]) -> Decision:
        require_replicas(replicas)
        chosen = replicas[self._next % len(replicas)]
        self._next += 1
        return build_decision(self.name, request, chosen, "round_robin", replicas)
