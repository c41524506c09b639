"""Routing policies: one file each behind `Policy.choose(request, replicas) -> Decision`.

Adding a policy is one file and one line in REGISTRY.
"""

from __future__ import annotations

import logging

from routing.policies.base import (Decision, NoReplicaAvailable, Policy, ReplicaScore,
                                   ReplicaState, RouteRequest)
from routing.policies.least_load import LeastLoadPolicy
from routing.policies.prefix_cost import PrefixCostPolicy
from routing.policies.prefix_hash import PrefixHashPolicy
from routing.policies.random_choice import RandomPolicy
from routing.policies.round_robin import RoundRobinPolicy
from routing.policies.session_affinity import SessionAffinityPolicy
from routing.policies.sglang import SglangPolicy

log = logging.getLogger(__name__)

REGISTRY: dict[str, type] = {
    "prefix_cost": PrefixCostPolicy,
    "round_robin": RoundRobinPolicy,
    "least_load": LeastLoadPolicy,
    "random": RandomPolicy,
    "prefix_hash": PrefixHashPolicy,
    "session_affinity": SessionAffinityPolicy,
    "sglang": SglangPolicy,
}

# Old names that configs written before a rename still use: old → registered name.
DEPRECATED_NAMES: dict[str, str] = {"kvgate": "prefix_cost"}


def policy_name(name: str) -> str:
    """The registered name `name` stands for; a deprecated alias logs a warning."""
    if name in DEPRECATED_NAMES:
        new = DEPRECATED_NAMES[name]
        log.warning("routing policy %r is deprecated; it now is %r", name, new)
        name = new
    if name not in REGISTRY:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(REGISTRY)}")
    return name


def make_policy(name: str, seed: int | None = None, **options) -> Policy:
    """Build a registered policy by name (options go to its constructor)."""
    return REGISTRY[policy_name(name)](seed=seed, **options)


__all__ = ["DEPRECATED_NAMES", "REGISTRY", "Decision", "NoReplicaAvailable", "Policy",
           "ReplicaScore", "ReplicaState", "RouteRequest", "make_policy", "policy_name"]
