"""A replica's KV tier in the gateway's index and cost: a tier hit is priced between a pool hit
and a miss, at the replica's measured restore cost."""

import pytest

from routing.hashing import block_hashes
from routing.index import PrefixIndex
from routing.policies.base import ReplicaState
from routing.policies.prefix_cost import prefix_cost
from routing.router import Router

TOKENS = list(range(1000, 1000 + 512))
HASHES = block_hashes(TOKENS, "m")


def router(**snapshots):
    r = Router("prefix_cost", seed=1)
    r.index.predicted_ttl_s = 0  # exact entries only: each route here is independent
    for name in ("a", "b", "c"):
        r.add_replica(name)
        r.on_snapshot(name, {"seq": 0, "block_size": 16, "blocks": [], "load": {},
                             **snapshots.get(name, {})})
    return r


def route(r: Router, **kw):
    """One request routed and finished at once: each route sees idle replicas."""
    decision = r.route(TOKENS, "m", **kw)
    r.finish(decision.request_id)
    return decision


def test_the_index_keeps_tier_blocks_from_snapshots_and_events():
    index = PrefixIndex()
    index.add_replica("a")
    index.apply_snapshot("a", {"seq": 0, "blocks": HASHES[:2], "tier_blocks": HASHES[:10]})
    depths = index.match(HASHES)
    assert depths == {"a": 2}
    assert index.match_tier(HASHES, depths) == {"a": 8}
    assert index.apply_event("a", {"seq": 1, "stored": [], "removed": [],
                                   "tier_stored": HASHES[10:20], "tier_removed": HASHES[5:6]})
    assert index.match_tier(HASHES, depths) == {"a": 3}  # blocks 2-4: block 5 left the tier
    assert index.apply_event("a", {"seq": 2, "cleared": True})
    assert index.match_tier(HASHES, index.match(HASHES)) == {}
    assert index.size().resident_entries == 0


def test_a_tier_hit_costs_between_a_pool_hit_and_a_miss():
    pool = ReplicaState("pool", cached_tokens=480)
    tier = ReplicaState("tier", tier_tokens=480, restore_cost=0.05)
    miss = ReplicaState("miss")
    costs = [prefix_cost(r, 512, 16) for r in (pool, tier, miss)]
    assert costs[0] < costs[1] < costs[2]
    assert costs[1] < 0.2 * costs[2]


def test_the_router_prefers_a_pool_hit_then_a_tier_hit_then_a_miss():
    r = router(a={"blocks": HASHES}, b={"tier_blocks": HASHES})
    assert {route(r).replica for _ in range(20)} == {"a"}
    decision = route(r, exclude=["a"])
    assert decision.replica == "b" and decision.reason == "tier_hit"
    assert decision.score_of("b").cost < decision.score_of("c").cost


def test_the_measured_restore_cost_prices_the_tier():
    r = router(b={"tier_blocks": HASHES})
    cheap = route(r, exclude=["a"]).score_of("b").cost
    r.on_event("b", {"seq": 1, "load": {"kv_tier": {"restore_cost": 0.5}}})
    dear = route(r, exclude=["a"]).score_of("b").cost
    assert dear > cheap
    assert r.replica_states(HASHES, 512)[1].restore_cost == pytest.approx(0.5)


def test_a_short_pool_hit_loses_to_a_long_tier_hit():
    r = router(a={"blocks": HASHES[:2]}, b={"tier_blocks": HASHES})
    assert {route(r).replica for _ in range(20)} == {"b"}
