"""Baseline modelled on SGLang's `cache_aware` router policy (sgl-model-gateway).

If loads are imbalanced (max - min > balance_abs AND max > balance_rel * min) route to the least
loaded replica; otherwise route to the best prefix match if its match rate exceeds
cache_threshold, else to the least loaded. Ties: (load, requests processed, index), as SGLang.
Defaults are the Python launcher's: 0.3 / 64 / 1.5.
"""

from __future__ import annotations

from routing.policies.base import (Decision, ReplicaState, RouteRequest, build_decision,
                                   require_replicas)


class SglangPolicy:
    name = "sglang"

    def __init__(self, seed: int | None = None, cache_threshold: float = 0.3,
                 balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._processed: dict[str, int] = {}

    def _least_loaded(self, replicas: list[ReplicaState]) -> ReplicaState:
        order = {r.name: i for i, r in enumerate(replicas)}
        return min(replicas, key=lambda r: (r.in_flight, self._processed.get(r.name, 0),
                                            order[r.name]))

    def choose(self, request: RouteRequest, replicas: list[ReplicaState]) -> Decision:
        require_replicas(replicas)
        loads = [r.in_flight for r in replicas]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            chosen, reason = self._least_loaded(replicas), "imbalance"
        else:
            best_cached = max(r.cached_tokens for r in replicas)
            rate = best_cached / request.prompt_tokens if request.prompt_tokens else 0.0
            if best_cached > 0 and rate > self.cache_threshold:
                chosen = self._least_loaded([r for r in replicas if r.cached_tokens == best_cached])
                reason = "cache_hit"
            else:
                chosen, reason = self._least_loaded(replicas), "cache_miss"
        self._processed[chosen.name] = self._processed.get(chosen.name, 0) + 1
        return build_decision(self.name, request, chosen, reason, replicas)
