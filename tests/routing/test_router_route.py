"""Router: index + load + policy in one call, fed by engine snapshots and events."""

from routing.hashing import block_hashes
from routing.router import Router

TOKENS = list(range(1000, 1000 + 512))


def router(policy="prefix_cost"):
    r = Router(policy, seed=1)
    for name in ("a", "b", "c"):
        r.add_replica(name)
        r.on_snapshot(name, {"seq": 0, "block_size": 16, "blocks": [], "load": {}})
    return r


def test_route_prefers_the_replica_whose_engine_reported_the_blocks():
    r = router()
    hashes = block_hashes(TOKENS, "m")
    assert r.on_event("c", {"seq": 1, "stored": hashes, "removed": [], "load": {"running": 0}})
    decision = r.route(TOKENS, "m")
    assert decision.replica == "c"
    # The engine always computes the last token: at most (512 - 1) // 16 blocks are cached.
    assert decision.cached_tokens == 31 * 16


def test_route_books_load_and_finish_releases_it():
    r = router()
    decision = r.route(TOKENS, "m", request_id="x")
    assert r.load.view(decision.replica).in_flight == 1
    assert r.load.view(decision.replica).pending_prefill_tokens == 512
    r.first_token("x")
    assert r.load.view(decision.replica).pending_prefill_tokens == 0
    r.finish("x")
    assert r.load.view(decision.replica).in_flight == 0


def test_sibling_sent_before_any_event_follows_the_first():
    r = router()
    first = r.route(TOKENS, "m")
    second = r.route(TOKENS, "m")
    assert second.replica == first.replica and second.reason == "cache_hit"


def test_other_tenant_does_not_see_the_cached_prefix():
    r = router()
    r.route(TOKENS, "m|tenant-a")
    assert r.route(TOKENS, "m|tenant-b").cached_tokens == 0


def test_excluded_replicas_are_skipped():
    r = router()
    picks = {r.route(TOKENS, "m", exclude=["a", "b"]).replica for _ in range(5)}
    assert picks == {"c"}


def test_event_gap_reports_resync_needed():
    r = router()
    assert r.on_event("a", {"seq": 1, "stored": []})
    assert not r.on_event("a", {"seq": 5, "stored": []})


def test_approximate_backend_is_learned_from_routing_history():
    r = Router("prefix_cost", seed=1)
    r.index.predicted_ttl_s = 0  # only the learned (approximate) entries remain
    r.add_replica("vllm-1", approximate=True, capacity_blocks=1000)
    r.add_replica("vllm-2", approximate=True, capacity_blocks=1000)
    first = r.route(TOKENS, "m")
    r.finish(first.request_id)
    second = r.route(TOKENS, "m")
    assert second.replica == first.replica and second.cached_tokens > 0
