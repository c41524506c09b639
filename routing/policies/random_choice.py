"""Baseline: a uniformly random replica."""

from __future__ import annotations

import random

from routing.policies.base import (Decision, ReplicaState, RouteRequest, build_decision,
                                   require_replicas)


class RandomPolicy:
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, replicas: list[ReplicaState]) -> Decision:
        require_replicas(replicas)
        return build_decision(self.name, request, self._rng.choice(replicas), "random", replicas)
