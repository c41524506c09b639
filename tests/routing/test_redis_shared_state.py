"""Shared routing state against a real redis-server: atomic route-and-reserve, leases,
shared predictions, rate-limit counters, and falling back to local state when Redis fails."""

import asyncio
from collections import Counter

import pytest

from routing.hashing import block_hashes
from routing.policies import NoReplicaAvailable, ReplicaState
from routing.policies.prefix_cost import UNCACHED_WEIGHT, prefix_cost
from routing.rate_limit import RateLimit, RateLimiter
from routing.redis_store import Candidate, RedisStore, StoreState
from routing.router import Router
from routing.shared_router import SharedRouter

REPLICAS = ("r0", "r1", "r2")


def gateway(url: str, seed: int, max_in_flight: int = 0, **store_kw) -> SharedRouter:
    router = Router("prefix_cost", seed=seed)
    for name in REPLICAS:
        router.add_replica(name)
    # generous: a loaded CI machine must not flip a test about sharing into local fallback
    store = RedisStore(url, timeout_s=store_kw.pop("timeout_s", 1.0),
                       retry_after_s=store_kw.pop("retry_after_s", 0.2), **store_kw)
    return SharedRouter(router, store, max_in_flight=max_in_flight, seed=seed)


def prompt(i: int) -> list[int]:
    return [i] * 20 + list(range(300))


async def test_two_gateways_never_double_book_beyond_capacity(redis_server):
    a, b = gateway(redis_server.url, 1, max_in_flight=4), gateway(redis_server.url, 2, max_in_flight=4)

    async def one(gw: SharedRouter, i: int):
        try:
            return (await gw.route(prompt(i), "m", request_id=f"q{i}")).replica
        except NoReplicaAvailable:
            return None

    picks = await asyncio.gather(*(one(a if i % 2 else b, i) for i in range(40)))
    booked = Counter(p for p in picks if p is not None)
    assert sum(booked.values()) == 4 * len(REPLICAS)
    assert all(n == 4 for n in booked.values())
    for name in REPLICAS:
        assert await a.store.in_flight(name) == 4
    assert a.state is StoreState.SHARED and b.state is StoreState.SHARED


async def test_finish_releases_the_shared_booking(redis_server):
    a, b = gateway(redis_server.url, 1, max_in_flight=1), gateway(redis_server.url, 2, max_in_flight=1)
    decisions = [await a.route(prompt(i), "m") for i in range(3)]
    with pytest.raises(NoReplicaAvailable):
        await b.route(prompt(9), "m")
    await a.finish(decisions[0].request_id)
    assert (await b.route(prompt(9), "m")).replica == decisions[0].replica


async def test_leases_of_a_dead_gateway_expire(redis_server):
    dead = gateway(redis_server.url, 1, max_in_flight=1, lease_s=1.0)
    for i in range(3):
        await dead.route(prompt(i), "m")  # booked, never finished: the gateway "died"
    live = gateway(redis_server.url, 2, max_in_flight=1)
    with pytest.raises(NoReplicaAvailable):
        await live.route(prompt(7), "m")
    await asyncio.sleep(1.1)
    assert (await live.route(prompt(7), "m")).replica in REPLICAS


async def test_sibling_through_another_gateway_follows_the_shared_prediction(redis_server):
    a, b = gateway(redis_server.url, 1), gateway(redis_server.url, 2)
    first = await a.route(prompt(1), "m")
    second = await b.route(prompt(1), "m")
    assert second.replica == first.replica
    assert second.reason == "cache_hit" and second.cached_tokens > 0


async def test_predicted_entries_expire_in_redis(redis_server):
    a = gateway(redis_server.url, 1, predicted_ttl_s=0.2)
    b = gateway(redis_server.url, 2, predicted_ttl_s=0.2)
    await a.route(prompt(1), "m")
    await asyncio.sleep(0.3)
    assert (await b.route(prompt(1), "m")).cached_tokens == 0


async def test_redis_killed_routing_continues_locally_then_shares_again(redis_server):
    a = gateway(redis_server.url, 1)
    assert (await a.route(prompt(1), "m")).reason in ("new_prefix", "cache_hit")
    redis_server.stop()
    decision = await asyncio.wait_for(a.route(prompt(2), "m"), timeout=2)
    assert decision.reason.startswith("local_fallback")
    assert a.state is StoreState.LOCAL_FALLBACK
    await a.finish(decision.request_id)  # releasing while Redis is down must not raise
    redis_server.start()
    await asyncio.sleep(0.25)  # retry_after_s
    decision = await a.route(prompt(3), "m")
    assert not decision.reason.startswith("local_fallback")
    assert a.state is StoreState.SHARED
    b = gateway(redis_server.url, 2)
    assert (await b.route(prompt(3), "m")).replica == decision.replica


async def test_slow_redis_falls_back_within_the_timeout(redis_server):
    a = gateway(redis_server.url, 1, timeout_s=0.1)
    await a.route(prompt(1), "m")
    blocker = RedisStore(redis_server.url, timeout_s=5)
    sleeper = asyncio.create_task(blocker.client.execute_command("DEBUG", "SLEEP", "0.6"))
    await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    started = loop.time()
    decision = await a.route(prompt(2), "m")
    assert loop.time() - started < 0.4
    assert decision.reason.startswith("local_fallback")
    await sleeper
    await blocker.close()


async def test_without_redis_url_nothing_needs_redis():
    router = Router("prefix_cost", seed=1)
    router.add_replica("r0")
    shared = SharedRouter(router, None)
    decision = await shared.route(prompt(1), "m")
    assert decision.replica == "r0" and shared.state is StoreState.DISABLED


async def test_lua_pick_agrees_with_python_cost(redis_server):
    store = RedisStore(redis_server.url, timeout_s=1)
    hashes = block_hashes(prompt(1), "m")
    candidates = [Candidate("a", 0), Candidate("b", 256), Candidate("c", 0)]
    pick = await store.route_and_reserve("x", candidates, hashes, 320, 16, 0.5)
    assert pick.replica == "b" and pick.reason == "cache_hit"
    costs = {s.replica: s.cost for s in pick.scores}
    assert costs == {"a": prefix_cost(ReplicaState("a"), 320, 16),
                     "b": prefix_cost(ReplicaState("b", cached_tokens=256), 320, 16),
                     "c": prefix_cost(ReplicaState("c"), 320, 16)}
    assert costs["a"] == (UNCACHED_WEIGHT * 320 + 16) * 1.0  # no load: the first factor alone
    await store.close()


async def test_rate_limit_counts_are_shared_and_fall_back_locally(redis_server):
    a, b = RateLimiter(RedisStore(redis_server.url)), RateLimiter(RedisStore(redis_server.url))
    limit = RateLimit(requests_per_minute=3, tokens_per_minute=1000)
    results = [await (a if i % 2 else b).check("key-1", 100, limit) for i in range(4)]
    assert [r.allowed for r in results] == [True, True, True, False]
    assert results[-1].shared and results[-1].requests == 4
    assert not (await a.check("key-2", 1001, limit)).allowed  # tokens over budget
    redis_server.stop()
    local = await a.check("key-1", 10, limit)
    assert local.allowed and not local.shared
