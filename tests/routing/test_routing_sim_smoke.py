"""The simulator drives the real router: on shared system prompts the cache-aware policy must
beat round robin on hit rate and TTFT, and never exceed the pooled upper bound by much."""

import random

from benchmarks.sim_engine import simulate
from benchmarks.sim_replica import pooled_upper_bound
from benchmarks.sim_workloads import multi_tenant


def test_kvgate_beats_round_robin_on_shared_system_prompts():
    requests = multi_tenant(random.Random(3), 400, 8.0, 16, tenants=12)
    kvgate = simulate(requests, "kvgate", 4, 512)
    rr = simulate(requests, "round_robin", 4, 512)
    upper = pooled_upper_bound(requests, 4 * 512, 16)
    assert kvgate.hit_rate > 1.5 * rr.hit_rate
    assert kvgate.hit_rate <= upper * 1.05
    assert kvgate.ttft_p50 < rr.ttft_p50
    assert kvgate.load_max_over_mean < 1.5


def test_shared_gateways_keep_the_hit_rate():
    requests = multi_tenant(random.Random(4), 400, 8.0, 16, tenants=12)
    one = simulate(requests, "kvgate", 4, 512)
    four = simulate(requests, "kvgate", 4, 512, gateways=4, shared=True)
    assert four.hit_rate >= 0.9 * one.hit_rate
