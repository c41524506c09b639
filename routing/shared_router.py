"""A gateway's router when state is shared through Redis: the prefix-cost pick and the load booking
happen in one Lua call across all gateways; if Redis is down or slow, the same request is
routed on local state (routing.router.Router) and the store's state says so."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from routing.hashing import block_hashes
from routing.policies import Decision, NoReplicaAvailable, ReplicaScore
from routing.policies.base import rendezvous_weight
from routing.policies.prefix_cost import PrefixCostPolicy
from routing.redis_store import Candidate, CostParams, RedisStore, StoreState
from routing.router import Router


class SharedRouter:
    def __init__(self, router: Router, store: RedisStore | None,
                 max_in_flight: int = 0, seed: int | None = None) -> None:
        self.router = router
        self.store = store
        self.max_in_flight = max_in_flight
        self._rng = random.Random(seed)
        self._booked_in_redis: set[str] = set()

    @property
    def state(self) -> StoreState:
        return StoreState.DISABLED if self.store is None else self.store.state

    def _params(self) -> CostParams:
        p = self.router.policy
        return CostParams(p.window_abs, p.window_rel, p.uncached_weight, p.batch_scale,
                          p.near_equal)

    async def route(self, token_ids: Sequence[int], namespace: str,
                    request_id: str | None = None, session_key: str | None = None,
                    exclude: Iterable[str] = (), priority: int = 0) -> Decision:
        hashes = block_hashes(token_ids, namespace, self.router.block_size)
        return await self.route_hashes(hashes, len(token_ids), request_id, session_key, exclude,
                                       priority)

    async def route_hashes(self, hashes: Sequence[int], prompt_tokens: int,
                           request_id: str | None = None, session_key: str | None = None,
                           exclude: Iterable[str] = (), priority: int = 0) -> Decision:
        router, policy = self.router, self.router.policy
        if self.store is None or not isinstance(policy, PrefixCostPolicy):
            # Only the prefix cost runs inside Redis; baselines stay per gateway.
            return router.route_hashes(hashes, prompt_tokens, request_id, session_key, exclude,
                                       priority)
        request_id = request_id or f"req-{self._rng.getrandbits(64):016x}"
        states = router.replica_states(hashes, prompt_tokens, exclude, priority)
        if not states:
            raise NoReplicaAvailable("no healthy replica")
        candidates = []
        for s in states:
            engine_in_flight, engine_pending = router.load.engine_counts(s.name, priority)
            # a tier hit enters the Lua cost as the pool hit of the same cost
            effective = s.cached_tokens + int(s.tier_tokens * (1.0 - s.restore_cost))
            candidates.append(Candidate(
                s.name, effective, self.max_in_flight, policy.saturated(s) is not None,
                engine_in_flight, engine_pending,
                0 if session_key is None else rendezvous_weight(session_key, s.name) + 1))
        pick = await self.store.route_and_reserve(
            request_id, candidates, hashes, prompt_tokens, router.block_size,
            self._rng.random(), self._params(), priority)
        if pick is None:
            decision = router.route_hashes(hashes, prompt_tokens, request_id, session_key, exclude,
                                           priority)
            decision.reason = f"local_fallback:{decision.reason}"
            return decision
        if pick.replica is None:
            raise NoReplicaAvailable("every replica is at its in-flight capacity")
        by_name = {s.name: s for s in states}
        scores = [ReplicaScore(sc.replica, sc.cached_tokens, sc.in_flight,
                               sc.pending_prefill_tokens, by_name[sc.replica].kv_usage, sc.cost,
                               policy.saturated(by_name[sc.replica]))
                  for sc in pick.scores]
        chosen = next(sc for sc in scores if sc.replica == pick.replica)
        decision = Decision(pick.replica, pick.reason, policy.name, scores, request_id,
                            chosen.cached_tokens)
        # Mirror the booking locally, so a Redis outage mid-request still has load to go on.
        router.commit(decision, hashes, prompt_tokens, priority)
        self._booked_in_redis.add(request_id)
        return decision

    async def first_token(self, request_id: str) -> None:
        booking = self.router.load.booking(request_id)
        self.router.first_token(request_id)
        if booking is not None and request_id in self._booked_in_redis and self.store:
            await self.store.first_token(booking.replica, request_id)

    async def finish(self, request_id: str) -> None:
        booking = self.router.load.booking(request_id)
        self.router.finish(request_id)
        if request_id in self._booked_in_redis:
            self._booked_in_redis.discard(request_id)
            if booking is not None and self.store is not None:
                # If Redis is down now, the lease simply expires.
                await self.store.finish(booking.replica, request_id)
