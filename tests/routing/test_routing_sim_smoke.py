"""The simulator drives the real router: on shared system prompts the cache-aware policy must
beat round robin on hit rate and TTFT, and never exceed the pooled upper bound by much."""

import random

from benchmarks.sim_engine import simulate
from benchmarks.sim_replica import pooled_upper_bound
from benchmarks.sim_workloads import multi_tenant


def test_prefix_cost_beats_round_robin_on_shared_system_prompts():
    requests = multi_tenant(random.Random(3), 400, 8.0, 16, tenants=12)
    prefix_cost = simulate(requests, "prefix_cost", 4, 512)
    rr = simulate(requests, "round_robin", 4, 512)
    upper = pooled_upper_bound(requests, 4 * 512, 16)
    assert prefix_cost.hit_rate > 1.5 * rr.hit_rate
    assert prefix_cost.hit_rate <= upper * 1.05
    assert prefix_cost.ttft_p50 < rr.ttft_p50
    assert prefix_cost.load_max_over_mean < 1.5


def test_shared_gateways_keep_the_hit_rate():
    requests = multi_tenant(random.Random(4), 400, 8.0, 16, tenants=12)
    one = simulate(requests, "prefix_cost", 4, 512)
    four = simulate(requests, "prefix_cost", 4, 512, gateways=4, shared=True)
    assert four.hit_rate >= 0.9 * one.hit_rate


def test_vllm_format_events_route_as_well_as_native_ones():
    """Replicas publishing vLLM-format events (their own hashes, decoded and mapped by the real
    code) keep the hit rate of kvgate's own events; no events at all lose part of it."""
    from benchmarks.sim_foreign import ZmqFeeds, ingest_rate
    from benchmarks.sim_workloads import MODEL

    requests = multi_tenant(random.Random(5), 300, 8.0, 16, tenants=12)
    native = simulate(requests, "prefix_cost", 4, 384)
    feeds = ZmqFeeds(MODEL, 16)
    zmq = simulate(requests, "prefix_cost", 4, 384, feed="zmq", zmq=feeds)
    two_blind = simulate(requests, "prefix_cost", 4, 384, gateways=2, shared=False, feed="none",
                         approx_capacity_blocks=8192)
    assert zmq.hit_rate >= 0.97 * native.hit_rate
    assert two_blind.hit_rate < zmq.hit_rate
    assert feeds.payloads and ingest_rate(feeds.payloads, MODEL, 16, repeat=1) > 0
