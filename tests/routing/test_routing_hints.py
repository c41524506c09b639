"""Routing hints (a session header, `prompt_cache_key`, `user`): a home replica by rendezvous
hashing where the index knows nothing, ignored where it knows better or the home is saturated;
the same decisions in memory and inside Redis."""

from __future__ import annotations

from collections import Counter

from routing.hashing import block_hashes
from routing.policies.base import ReplicaState, RouteRequest, home_of
from routing.policies.prefix_cost import PrefixCostPolicy
from routing.router import Router
from routing.shared_router import SharedRouter
from routing.redis_store import RedisStore

REPLICAS = ("r0", "r1", "r2", "r3")


def router(seed: int = 1) -> Router:
    r = Router("prefix_cost", seed=seed)
    for name in REPLICAS:
        r.add_replica(name)
        r.on_snapshot(name, {"seq": 0, "block_size": 16, "blocks": [], "load": {}})
    return r


def short_prompt(i: int) -> list[int]:
    return [7, i, i + 1]  # shorter than a block: the index can never know it


def home(key: str) -> str:
    return home_of(key, [ReplicaState(n) for n in REPLICAS]).name


def test_a_session_returns_to_its_home_while_the_index_knows_nothing():
    r = router()
    for session in ("s-1", "s-2", "s-3"):
        picks = set()
        for turn in range(6):
            picks.add(r.route(short_prompt(turn), "m", session_key=session, request_id="q").replica)
            r.finish("q")
        assert picks == {home(session)}


def test_a_busy_home_spills_inside_the_load_window():
    r = router()
    picks = Counter(r.route(short_prompt(t), "m", session_key="s-1").replica for t in range(12))
    assert picks[home("s-1")] == 5 and len(picks) > 1  # in flight: at most min + 4 on one


def test_without_a_hint_new_prefixes_rotate_over_the_replicas():
    r = router()
    picks = Counter(r.route(short_prompt(i), "m").replica for i in range(8))
    assert set(picks) == set(REPLICAS)


def test_sessions_spread_over_the_replicas():
    r = router()
    picks = Counter()
    for s in range(200):
        decision = r.route(short_prompt(s), "m", session_key=f"user-{s}", request_id=f"q{s}")
        r.finish(f"q{s}")
        picks[decision.replica] += 1
        assert decision.reason == "session_hint"
    assert set(picks) == set(REPLICAS) and max(picks.values()) < 80


def test_the_index_knows_better_than_the_hint():
    r = router()
    tokens = list(range(100, 400))
    holder = next(n for n in REPLICAS if n != home("s-1"))
    r.on_event(holder, {"seq": 1, "stored": block_hashes(tokens, "m"), "removed": []})
    decision = r.route(tokens, "m", session_key="s-1")
    assert decision.replica == holder and decision.reason == "cache_hit"


def test_a_saturated_or_overloaded_home_is_passed_over():
    policy = PrefixCostPolicy(seed=1)
    request = RouteRequest("x", [], 3, session_key="s-1")
    names = list(REPLICAS)
    states = [ReplicaState(n) for n in names]
    target = home("s-1")
    assert policy.choose(request, states).replica == target
    full = [ReplicaState(n, kv_usage=0.99 if n == target else 0.1) for n in names]
    assert policy.choose(request, full).replica != target
    busy = [ReplicaState(n, in_flight=40 if n == target else 0) for n in names]
    assert policy.choose(request, busy).replica != target


def test_replicas_tied_on_a_shared_prefix_break_the_tie_by_the_hint():
    policy = PrefixCostPolicy(seed=1)
    # Every replica holds the shared system prompt (256 tokens): a tie on cost.
    states = [ReplicaState(n, cached_tokens=256) for n in REPLICAS]
    for session in ("a", "b", "c", "d", "e"):
        request = RouteRequest("x", [], 300, session_key=session)
        assert {policy.choose(request, states).replica for _ in range(5)} == {home(session)}


async def test_redis_picks_the_same_home_as_the_local_policy(redis_server):
    local = router()
    shared = SharedRouter(router(seed=2), RedisStore(redis_server.url, timeout_s=1.0), seed=2)
    for s in range(12):
        session = f"session-{s}"
        want = local.route(short_prompt(s), "m", session_key=session, request_id=f"l{s}")
        got = await shared.route(short_prompt(s), "m", session_key=session, request_id=f"r{s}")
        local.finish(f"l{s}")
        await shared.finish(f"r{s}")
        assert got.replica == want.replica == home(session)
        assert got.reason == "session_hint"
    tokens = list(range(100, 400))
    holder = next(n for n in REPLICAS if n != home("session-0"))
    shared.router.on_event(holder, {"seq": 1, "stored": block_hashes(tokens, "m"), "removed": []})
    decision = await shared.route(tokens, "m", session_key="session-0")
    assert decision.replica == holder and decision.reason == "cache_hit"
    await shared.store.close()
