"""The prefix-cost policy: a replica's cached prefix and its load in one cost in tokens of work,
guards, and no herding.

    cost(r) = (3 * uncached_tokens(r) + pending_prefill_tokens(r) + block_size)
              * (1 + in_flight(r) / 4)

The first factor is prefill work in tokens. Prefix tokens a replica holds only in its KV tier
(host memory or disk below its pool) count as `restore_cost` of an uncached token each - the
replica's measured restore time per token over its prefill time per token - so a tier hit
lands between a pool hit and a miss. The request waits for the prefill already queued
on r (pending) and for its own uncached tokens. Its uncached tokens count three times: once
for its own wait, once as new work every later request on r waits behind, and once for the
blocks they take in r's cache, evicting blocks later requests would read (and, where another
replica holds the prefix, only to keep a second copy of it). Pending prefill counts once: that
work happens wherever this request goes, and when r is computing this very prefix (a sibling
routed a moment ago) waiting for it is the cheap choice. `block_size` is the floor of one block of work, so a fully cached replica still costs
more as its batch grows. The second factor is batch drag: the sequences in flight share r's
steps. LMetric uses (in_flight + 1); dividing by 4 softens it so that one extra request in
flight does not double the cost - with the full factor, the second of a burst of siblings
already finds the replica computing its prefix "as expensive" as recomputing it elsewhere, and
siblings scatter.

Around the cost:
  * guards drop replicas whose KV cache is nearly full or whose queue is long;
  * candidates are limited to the near-least-loaded window (in-flight at most
    min + max(window_abs, window_rel x min)), so a hot prefix spills over instead of piling up - and inside that window
    the best-cached replica still wins (affinity is kept, not dropped, under imbalance);
  * a random pick among near-equal costs, never the first index;
  * a prompt no replica holds goes to the replica that took a new prefix least recently, so new
    prefixes spread and every replica's cache is used;
  * a routing hint (the client's session header, `prompt_cache_key` or `user`) names a home
    replica by rendezvous hashing. Where the index knows nothing of the prompt (a first turn,
    a prefix shorter than a block, a new tenant) the home inside the load window takes it
    instead of the rotation; where replicas tie on cost, the home among them wins instead of a
    random one. The index's knowledge and the guards come first: a hint never beats a cached
    prefix, nor puts a request on a saturated or overloaded replica.
"""

from __future__ import annotations

import itertools
import random

from routing.policies.base import (Decision, ReplicaState, RouteRequest, build_decision,
                                   home_of, require_replicas)


UNCACHED_WEIGHT = 3.0


def prefix_cost(r: ReplicaState, prompt_tokens: int, block_size: int,
                uncached_weight: float = UNCACHED_WEIGHT, batch_scale: float = 4.0,
                weigh_kv_room: bool = False) -> float:
    """`weigh_kv_room` (decode replicas of a P/D pair): divide by the free share of the KV
    cache, so a replica whose cache is half full costs twice as much."""
    uncached = max(0, prompt_tokens - r.cached_tokens - r.tier_tokens)
    restore = r.tier_tokens * r.restore_cost  # a tier hit, in prefill tokens of work
    cost = float((uncached_weight * (uncached + restore) + r.pending_prefill_tokens + block_size)
                 * (1.0 + r.in_flight / batch_scale))
    return cost / max(0.05, 1.0 - r.kv_usage) if weigh_kv_room else cost


class PrefixCostPolicy:
    name = "prefix_cost"

    def __init__(
        self,
        seed: int | None = None,
        kv_usage_guard: float = 0.95,
        max_waiting: int = 32,
        window_rel: float = 0.25,
        window_abs: int = 4,
        near_equal: float = 0.05,
        uncached_weight: float = UNCACHED_WEIGHT,
        batch_scale: float = 4.0,
        weigh_kv_room: bool = False,
    ) -> None:
        self.batch_scale = batch_scale
        self.weigh_kv_room = weigh_kv_room
        self.uncached_weight = uncached_weight
        self._rng = random.Random(seed)
        self.kv_usage_guard = kv_usage_guard
        self.max_waiting = max_waiting
        self.window_rel = window_rel
        self.window_abs = window_abs
        self.near_equal = near_equal
        self._new_prefix_turn: dict[str, int] = {}
        self._turns = itertools.count(1)

    def saturated(self, r: ReplicaState) -> str | None:
        if r.kv_usage >= self.kv_usage_guard:
            return "kv_usage"
        if r.waiting >= self.max_waiting:
            return "queue"
        return None

    def choose(self, request: RouteRequest, replicas: list[ReplicaState]) -> Decision:
        require_replicas(replicas)
        excluded = {r.name: why for r in replicas if (why := self.saturated(r))}
        candidates = [r for r in replicas if r.name not in excluded] or list(replicas)
        all_saturated = len(excluded) == len(replicas)
        lo = min(r.in_flight for r in candidates)
        limit = lo + max(self.window_abs, self.window_rel * lo)
        window = []
        for r in candidates:
            if r.in_flight <= limit:
                window.append(r)
            else:
                excluded.setdefault(r.name, "load_window")
        costs = {r.name: prefix_cost(r, request.prompt_tokens, request.block_size,
                                    self.uncached_weight, self.batch_scale, self.weigh_kv_room)
                 for r in replicas}
        best = min(costs[r.name] for r in window)
        near = [r for r in window if costs[r.name] <= best * (1 + self.near_equal)]
        best_cached = max(r.cached_tokens + r.tier_tokens for r in candidates)
        hint = request.session_key
        if best_cached == 0:
            if hint is not None:
                chosen, reason = home_of(hint, window), "session_hint"
            else:
                # A new prefix: rotate it onto the replica that least recently took one.
                oldest = min(self._new_prefix_turn.get(r.name, 0) for r in near)
                chosen = self._rng.choice(
                    [r for r in near if self._new_prefix_turn.get(r.name, 0) == oldest])
                reason = "new_prefix"
            self._new_prefix_turn[chosen.name] = next(self._turns)
        else:
            chosen = home_of(hint, near) if hint is not None else self._rng.choice(near)
            held = chosen.cached_tokens + chosen.tier_tokens
            reason = ("load_window" if held < best_cached
                      else "cache_hit" if chosen.cached_tokens >= chosen.tier_tokens
                      else "tier_hit")
        if all_saturated:
            reason = "all_saturated"
        return build_decision(self.name, request, chosen, reason, replicas, costs, excluded)
