"""Routing policies: one file each behind `Policy.choose(request, replicas) -> Decision`.

Adding a policy is one file and one line in REGISTRY.
"""

from __future__ import annotations

from routing.policies.base import (Decision, NoReplicaAvailable, Policy, ReplicaScore,
                                   ReplicaState, RouteRequest)
from routing.policies.kvgate import KvgatePolicy
from routing.policies.least_load import LeastLoadPolicy
from routing.policies.prefix_hash import PrefixHashPolicy
from routing.policies.random_choice import RandomPolicy
from routing.policies.round_robin import RoundRobinPolicy
from routing.policies.session_affinity import SessionAffinityPolicy
from routing.policies.sglang import SglangPolicy

REGISTRY: dict[str, type] = {
    "kvgate": KvgatePolicy,
    "round_robin": RoundRobinPolicy,
    "least_load": LeastLoadPolicy,
    "random": RandomPolicy,
    "prefix_hash": PrefixHashPolicy,
    "session_affinity": SessionAffinityPolicy,
    "sglang": SglangPolicy,
}


def make_policy(name: str, seed: int | None = None, **options) -> Policy:
    """Build a registered policy by name (options go to its constructor)."""
    try:
        cls = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose from {sorted(REGISTRY)}") from None
    return cls(seed=seed, **options)


__all__ = ["REGISTRY", "Decision", "NoReplicaAvailable", "Policy", "ReplicaScore",
           "ReplicaState", "RouteRequest", "make_policy"]
