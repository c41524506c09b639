"""The routing step in one place: block hashes -> prefix index match -> load view -> policy ->
predicted entries written and load reserved. One Router per gateway process."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from routing.hashing import DEFAULT_BLOCK_SIZE, block_hashes
from routing.index import PrefixIndex
from routing.load import LoadTracker
from routing.policies import Decision, NoReplicaAvailable, Policy, ReplicaState, RouteRequest
from routing.policies import make_policy
from routing.policies.pd import PDDecision, PDPolicy


@dataclass(slots=True)
class ReplicaInfo:
    name: str
    approximate: bool = False


class Router:
    def __init__(
        self,
        policy: Policy | str = "prefix_cost",
        index: PrefixIndex | None = None,
        load: LoadTracker | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = make_policy(policy, seed=seed) if isinstance(policy, str) else policy
        self.pd_policy = PDPolicy(seed=seed)  # prefill/decode pairs, when replicas have roles
        self.index = index or PrefixIndex(block_size=block_size, clock=clock)
        self.load = load or LoadTracker(clock=clock)
        self.block_size = self.index.block_size
        self.replicas: dict[str, ReplicaInfo] = {}
        self._ids = itertools.count()

    # -- replica membership and engine feeds ----------------------------------------------
    def add_replica(self, name: str, approximate: bool = False,
                    capacity_blocks: int | None = None) -> None:
        """Register a replica; `approximate` for backends without KV events (index learned from
        routing history, as an LRU of `capacity_blocks`)."""
        if approximate and not capacity_blocks:
            raise ValueError("an approximate replica needs capacity_blocks")
        self.replicas[name] = ReplicaInfo(name, approximate=approximate)
        self.index.add_replica(name, approximate, capacity_blocks if approximate else None)
        self.load.add_replica(name)

    def remove_replica(self, name: str) -> None:
        self.replicas.pop(name, None)
        self.index.remove_replica(name)
        self.load.remove_replica(name)

    def on_snapshot(self, name: str, snapshot: Mapping) -> None:
        self.index.apply_snapshot(name, snapshot)
        self.load.observe_engine(name, snapshot.get("load"))

    def on_event(self, name: str, event: Mapping) -> bool:
        """Apply a KV event; False means: re-read this replica's snapshot."""
        self.load.observe_engine(name, event.get("load"))
        return self.index.apply_event(name, event)

    def on_blocks(self, name: str, stored: Sequence[int], removed: Sequence[int],
                  tier_stored: Sequence[int] = (), tier_removed: Sequence[int] = ()) -> None:
        """Apply canonical blocks mapped from a foreign engine's events (pool, then KV tier)."""
        self.index.apply_blocks(name, stored, removed, tier_stored, tier_removed)

    def set_approximate(self, name: str, approximate: bool,
                        capacity_blocks: int | None = None) -> None:
        """Fall back to (or leave) the index learned from routing history, keeping the load."""
        if approximate and not capacity_blocks:
            raise ValueError("an approximate replica needs capacity_blocks")
        self.replicas[name].approximate = approximate
        self.index.set_approximate(name, approximate, capacity_blocks)

    # -- routing --------------------------------------------------------------------------
    def replica_states(self, hashes: Sequence[int], prompt_tokens: int,
                       exclude: Iterable[str] = (), priority: int = 0) -> list[ReplicaState]:
        """What a policy sees for each routable replica: predicted cached tokens, and the load
        of priority <= `priority` (the work a request of that priority waits behind)."""
        skip = set(exclude)
        matched = self.index.match(hashes)
        tier = self.index.match_tier(hashes, matched)
        # An engine always computes the prompt's last token, so at most (n-1)//B blocks hit.
        max_blocks = max(0, (prompt_tokens - 1) // self.block_size)
        states = []
        for info in self.replicas.values():
            if info.name in skip:
                continue
            view = self.load.view(info.name, priority)
            pool = min(matched.get(info.name, 0), max_blocks)
            state = ReplicaState(
                info.name, pool * self.block_size, view.in_flight, view.pending_prefill_tokens,
                view.waiting, view.kv_usage, info.approximate)
            if info.name in tier:
                state.tier_tokens = min(tier[info.name], max_blocks - pool) * self.block_size
                cost = self.load.restore_cost(info.name)
                if cost is not None:
                    state.restore_cost = cost
            states.append(state)
        return states

    def route(self, token_ids: Sequence[int], namespace: str, request_id: str | None = None,
              session_key: str | None = None, exclude: Iterable[str] = (),
              priority: int = 0) -> Decision:
        """Choose a replica for a tokenised prompt, predict its blocks there and book its load."""
        hashes = block_hashes(token_ids, namespace, self.block_size)
        return self.route_hashes(hashes, len(token_ids), request_id, session_key, exclude,
                                 priority)

    def route_hashes(self, hashes: Sequence[int], prompt_tokens: int,
                     request_id: str | None = None, session_key: str | None = None,
                     exclude: Iterable[str] = (), priority: int = 0) -> Decision:
        request = RouteRequest(request_id or f"req-{next(self._ids)}", hashes, prompt_tokens,
                               self.block_size, session_key, priority)
        states = self.replica_states(hashes, prompt_tokens, exclude, priority)
        if not states:
            raise NoReplicaAvailable("no healthy replica")
        decision = self.policy.choose(request, states)
        self.commit(decision, hashes, prompt_tokens, priority)
        return decision

    def commit(self, decision: Decision, hashes: Sequence[int], prompt_tokens: int,
               priority: int = 0) -> None:
        """Write the chosen replica's predicted blocks and reserve its load locally."""
        self.index.record_route(decision.replica, hashes)
        self.load.reserve(decision.request_id, decision.replica,
                          prompt_tokens - decision.cached_tokens, priority)

    def route_pd(self, hashes: Sequence[int], prompt_tokens: int, request_id: str,
                 prefill: Iterable[str], decode: Iterable[str], exclude: Iterable[str] = (),
                 priority: int = 0) -> PDDecision:
        """Choose a prefill/decode pair (or a bypass) among the named replicas; book both.
        Bookings are "<request_id>-d" (the decode replica, until the stream ends) and
        "<request_id>-p" (the prefill replica, until its half answers)."""
        request = RouteRequest(request_id, hashes, prompt_tokens, self.block_size, None, priority)
        states = self.replica_states(hashes, prompt_tokens, exclude, priority)
        p_names, d_names = set(prefill), set(decode)
        pick = self.pd_policy.choose(request, [s for s in states if s.name in p_names],
                                     [s for s in states if s.name in d_names])
        d = pick.decode
        d.request_id = f"{request_id}-d"
        uncached = max(0, prompt_tokens - d.cached_tokens)
        # the decode replica prefills what it lacks (bypass), else only the unsent tail
        self.index.record_route(d.replica, hashes)
        self.load.reserve(d.request_id, d.replica,
                          uncached if pick.bypass else min(uncached, self.block_size), priority)
        if pick.prefill is not None:
            pick.prefill.request_id = f"{request_id}-p"
            self.commit(pick.prefill, hashes, prompt_tokens, priority)
        return pick

    def first_token(self, request_id: str) -> None:
        self.load.first_token(request_id)

    def finish(self, request_id: str) -> None:
        self.load.finish(request_id)
