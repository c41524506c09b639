"""Priority-aware load: a request of priority p competes only with work of priority <= p — in
this gateway's bookings, in the engine's report, and in the Redis shared state."""

import asyncio

from routing.hashing import block_hashes
from routing.load import LoadTracker
from routing.redis_store import Candidate, RedisStore
from routing.router import Router
from routing.shared_router import SharedRouter
from tests.routing.test_load_tracker import FakeClock

BATCH, CHAT = 10, 0


def tracker():
    clock = FakeClock()
    t = LoadTracker(engine_stale_after_s=5.0, clock=clock)
    t.add_replica("a")
    return t, clock


def test_view_counts_only_bookings_of_equal_or_higher_priority():
    t, _ = tracker()
    for i in range(5):
        t.reserve(f"batch-{i}", "a", 1000, priority=BATCH)
    t.reserve("chat", "a", 50, priority=CHAT)
    assert (t.view("a", CHAT).in_flight, t.view("a", CHAT).pending_prefill_tokens) == (1, 50)
    assert (t.view("a", BATCH).in_flight, t.view("a", BATCH).pending_prefill_tokens) == (6, 5050)
    assert t.view("a", 5).in_flight == 1
    assert t.view("a").in_flight == 6  # no priority: everything (metrics, dashboard)
    t.first_token("batch-0")
    t.finish("chat")
    assert (t.view("a", CHAT).in_flight, t.view("a", CHAT).pending_prefill_tokens) == (0, 0)
    assert t.view("a", BATCH).pending_prefill_tokens == 4000
    for i in range(5):
        t.finish(f"batch-{i}")
    assert (t.view("a").in_flight, t.view("a").pending_prefill_tokens) == (0, 0)


def test_engine_breakdown_by_priority_is_filtered_too():
    t, clock = tracker()
    t.observe_engine("a", {"running": 8, "waiting": 12, "pending_prefill_tokens": 9000,
                           "by_priority": {"0": {"running": 1, "waiting": 0,
                                                 "pending_prefill_tokens": 30},
                                           "10": {"running": 7, "waiting": 12,
                                                  "pending_prefill_tokens": 8970}}})
    clock.now = 1.0
    t.reserve("late-batch", "a", 500, priority=BATCH)
    t.reserve("late-chat", "a", 40, priority=CHAT)
    chat = t.view("a", CHAT)
    assert (chat.in_flight, chat.pending_prefill_tokens, chat.waiting) == (2, 70, 0)
    batch = t.view("a", BATCH)
    assert (batch.in_flight, batch.pending_prefill_tokens, batch.waiting) == (22, 9540, 12)
    assert t.engine_counts("a", CHAT) == (1, 30)


def test_an_engine_without_a_breakdown_counts_for_every_priority():
    t, _ = tracker()
    t.observe_engine("a", {"running": 4, "waiting": 3, "pending_prefill_tokens": 100})
    assert t.view("a", -5).in_flight == 7 and t.view("a", -5).waiting == 3
    t.observe_engine("a", {"running": 4, "waiting": 3, "by_priority": {"x": {}}})  # malformed
    assert t.view("a", -5).in_flight == 7


def two_replicas(policy: str = "least_load") -> Router:
    r = Router(policy, seed=3)
    r.add_replica("a")
    r.add_replica("b")
    for i in range(8):
        r.load.reserve(f"batch-{i}", "a", 200, priority=BATCH)
    for i in range(2):
        r.load.reserve(f"chat-{i}", "b", 20, priority=CHAT)
    return r


def test_policy_routes_a_chat_past_batch_load_and_batch_away_from_it():
    r = two_replicas()
    chat = r.route(list(range(40)), "m", request_id="chat-new", priority=CHAT)
    assert chat.replica == "a"
    assert (chat.score_of("a").in_flight, chat.score_of("b").in_flight) == (0, 2)
    batch = r.route(list(range(100, 140)), "m", request_id="batch-new", priority=BATCH)
    assert batch.replica == "b"
    assert (batch.score_of("a").in_flight, batch.score_of("b").in_flight) == (9, 2)
    assert r.load.booking("chat-new").priority == CHAT


def test_prefix_cost_sees_only_competing_load():
    r = two_replicas("prefix_cost")
    decision = r.route(list(range(40)), "m", request_id="q", priority=CHAT)
    assert decision.score_of("a").pending_prefill_tokens == 0
    assert decision.score_of("b").pending_prefill_tokens == 40
    assert decision.replica == "a"


def gateway(url: str, seed: int) -> SharedRouter:
    router = Router("prefix_cost", seed=seed)
    for name in ("a", "b"):
        router.add_replica(name)
    return SharedRouter(router, RedisStore(url, timeout_s=0.5), seed=seed)


async def test_redis_counts_only_leases_of_equal_or_higher_priority(redis_server):
    store = RedisStore(redis_server.url, timeout_s=1)
    hashes = block_hashes(list(range(64)), "m")
    for i in range(5):  # batch load on "a", booked by some gateway
        await store.route_and_reserve(f"batch-{i}", [Candidate("a")], hashes, 64, 16, 0.5,
                                      priority=BATCH)
    for i in range(2):
        await store.route_and_reserve(f"chat-{i}", [Candidate("b")], hashes, 64, 16, 0.5,
                                      priority=CHAT)
    other = block_hashes(list(range(500, 564)), "m")
    pick = await store.route_and_reserve("chat-new", [Candidate("a"), Candidate("b")], other,
                                         64, 16, 0.5, priority=CHAT)
    scores = {s.replica: s for s in pick.scores}
    assert (scores["a"].in_flight, scores["b"].in_flight) == (0, 2)
    assert scores["a"].pending_prefill_tokens == 0 and pick.replica == "a"
    pick = await store.route_and_reserve("batch-new", [Candidate("a"), Candidate("b")], other,
                                         64, 16, 0.5, priority=BATCH)
    scores = {s.replica: s for s in pick.scores}
    assert (scores["a"].in_flight, scores["b"].in_flight) == (6, 2)
    # batch-0's 64 tokens, 16 for each of four more (3 predicted blocks hit), chat-new's 64
    assert scores["a"].pending_prefill_tokens == 64 + 4 * 16 + 64
    await store.close()


async def test_redis_capacity_counts_every_lease_whatever_its_priority(redis_server):
    store = RedisStore(redis_server.url, timeout_s=1)
    hashes = block_hashes(list(range(64)), "m")
    for i in range(3):
        await store.route_and_reserve(f"batch-{i}", [Candidate("a", max_in_flight=3)], hashes,
                                      64, 16, 0.5, priority=BATCH)
    pick = await store.route_and_reserve("chat", [Candidate("a", max_in_flight=3)], hashes, 64,
                                         16, 0.5, priority=CHAT)
    assert pick.replica is None and pick.reason == "no_capacity"
    await store.close()


async def test_finished_and_expired_leases_leave_no_priority_behind(redis_server):
    store = RedisStore(redis_server.url, timeout_s=1, lease_s=0.2)
    hashes = block_hashes(list(range(64)), "m")
    await store.route_and_reserve("done", [Candidate("a")], hashes, 64, 16, 0.5, priority=BATCH)
    await store.route_and_reserve("lost", [Candidate("a")], hashes, 64, 16, 0.5, priority=BATCH)
    await store.finish("a", "done")
    assert await store.client.hkeys(store._key("prio", "a")) == ["lost"]
    await asyncio.sleep(0.3)
    await store.route_and_reserve("next", [Candidate("a")], hashes, 64, 16, 0.5, priority=CHAT)
    assert await store.client.hkeys(store._key("prio", "a")) == ["next"]
    await store.close()


async def test_two_gateways_share_priority_aware_load(redis_server):
    a, b = gateway(redis_server.url, 1), gateway(redis_server.url, 2)
    batch = [await a.route(list(range(i * 100, i * 100 + 64)), "m", request_id=f"batch-{i}",
                           priority=BATCH) for i in range(6)]
    loaded = max(("a", "b"), key=lambda n: sum(d.replica == n for d in batch))
    chat = await b.route(list(range(9000, 9064)), "m", request_id="chat", priority=CHAT)
    assert chat.score_of(loaded).in_flight == 0  # b sees a's batch leases, and skips them
    batch_view = await b.route(list(range(7000, 7064)), "m", request_id="batch-x", priority=BATCH)
    assert batch_view.score_of(loaded).in_flight >= 3
    assert a.router.load.booking("batch-0").priority == BATCH
    for gw in (a, b):
        await gw.store.close()
