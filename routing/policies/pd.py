"""Choosing a prefill/decode pair, with the prefix cost (prefix_cost.py) on each side.

    decode cost(d)  = prefix_cost(d, uncached weight TRANSFER_WEIGHT) / (1 - kv_usage(d))
    prefill cost(p) = prefix_cost(p)              (as for a whole request)

The decode replica is chosen first: it keeps the request for all of its decode, so its
in-flight decodes (the batch factor), its pending prefill (which stalls its decodes) and its KV
room weigh most; each prompt token it lacks costs TRANSFER_WEIGHT (a block arriving is far
cheaper than a block computed, but not free). When it lacks at most `bypass_tokens` of the
prompt it prefills them itself - the bypass: no prefill replica, no transfer. Otherwise the
prefill replica is the one with the least prefill work for this prompt (its cached prefix and
pending prefill). The pair's cost is the sum of two terms that share no replica, so choosing each
side on its own finds the cheapest pair. Both sides keep the prefix-cost policy's guards, load
window and random pick among near-equal costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.policies.base import Decision, NoReplicaAvailable, ReplicaState, RouteRequest
from routing.policies.prefix_cost import PrefixCostPolicy

TRANSFER_WEIGHT = 0.25
BYPASS_TOKENS = 64


@dataclass(slots=True)
class PDDecision:
    decode: Decision
    prefill: Decision | None  # None: the decode replica prefills the prompt itself
    reason: str  # "pair" | "bypass" | "no_prefill_replica"

    @property
    def bypass(self) -> bool:
        return self.prefill is None


class PDPolicy:
    name = "pd"

    def __init__(self, seed: int | None = None, bypass_tokens: int = BYPASS_TOKENS,
                 transfer_weight: float = TRANSFER_WEIGHT) -> None:
        self.bypass_tokens = bypass_tokens
        self.prefill = PrefixCostPolicy(seed=seed)
        self.decode = PrefixCostPolicy(seed=None if seed is None else seed + 1,
                                       uncached_weight=transfer_weight, weigh_kv_room=True)

    def choose(self, request: RouteRequest, prefill: list[ReplicaState],
               decode: list[ReplicaState]) -> PDDecision:
        if not decode:
            raise NoReplicaAvailable("no healthy decode replica")
        d = self.decode.choose(request, decode)
        uncached = request.prompt_tokens - d.cached_tokens
        if uncached <= self.bypass_tokens:
            return PDDecision(_named(d, "pd_decode"), None, "bypass")
        if not prefill:
            return PDDecision(_named(d, "pd_decode"), None, "no_prefill_replica")
        p = self.prefill.choose(request, prefill)
        return PDDecision(_named(d, "pd_decode"), _named(p, "pd_prefill"), "pair")


def _named(decision: Decision, policy: str) -> Decision:
    decision.policy = policy
    return decision
