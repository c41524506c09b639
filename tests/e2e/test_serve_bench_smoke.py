"""serve_bench end to end on a tiny cluster (2 tiny-random replicas + 1 gateway), plus the
pure parts (workloads, percentiles, trace replay). Well under a minute on 2 cores."""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks.serve_bench_stats import parse_prometheus, percentile
from benchmarks.serve_bench_workloads import WorkloadParams, build


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0


def test_multi_tenant_prompts_share_system_prefix():
    jobs = build("multi_tenant", WorkloadParams(num_requests=40, tenants=3, prompt_tokens=64))
    by_group: dict[str, list[list[int]]] = {}
    for job in jobs:
        (r,) = job.stages[0]
        by_group.setdefault(r.group, []).append(r.prompt)
    assert len(by_group) <= 3 and sum(map(len, by_group.values())) == 40
    for prompts in by_group.values():
        assert all(p[:64] == prompts[0][:64] for p in prompts)


def test_multi_turn_and_best_of_n_shapes():
    chats = build("multi_turn", WorkloadParams(num_requests=12, turns=3, prompt_tokens=32))
    assert sum(j.num_requests for j in chats) == 12
    first, second = chats[0].stages[0][0].prompt, chats[0].stages[1][0].prompt
    assert second[: len(first)] == first and len(second) > len(first)
    bursts = build("best_of_n", WorkloadParams(num_requests=8, siblings=4))
    assert [len(j.stages[0]) for j in bursts] == [4, 4]


def test_trace_shared_hash_ids_share_prefix(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 40, "output_length": 500, "hash_ids": [1, 2, 3]},
            {"timestamp": 1000, "input_length": 1100, "output_length": 9, "hash_ids": [1, 2, 7]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    a, b = build("trace", WorkloadParams(num_requests=5, trace=str(path), output_tokens=8,
                                         trace_time_scale=0.5))
    pa, pb = a.stages[0][0].prompt, b.stages[0][0].prompt
    assert len(pa) == 40 and pa[:32] == pb[:32] and pa[32:] != pb[32:40]
    assert len(pb) == 2 * 16 + 3  # 512-token blocks rescaled as the _bs16 files are: ceil(76 * 16 / 512)
    assert a.stages[0][0].max_tokens == 8 and b.arrival == 0.5


def test_parse_prometheus_sums_labels():
    text = '# HELP x\nkvgate_request_success_total{finished_reason="length"} 3\n' \
           'kvgate_request_success_total{finished_reason="stop"} 2\nkvgate_prefix_cache_hits_tokens_total 7.0\n'
    m = parse_prometheus(text)
    assert m["kvgate_request_success_total"] == 5 and m["kvgate_prefix_cache_hits_tokens_total"] == 7


@pytest.mark.timeout(90)
def test_live_tiny_cluster():
    from benchmarks.serve_bench import run_load
    from benchmarks.serve_bench_cluster import Cluster, ClusterSpec

    jobs = build("multi_tenant", WorkloadParams(num_requests=12, tenants=2, prompt_tokens=64,
                                                suffix_tokens=8, output_tokens=4))
    with Cluster(ClusterSpec(replicas=2, gateways=1, model="tiny-random", num_kv_blocks=128,
                                 enforce_eager=True)) as cluster:
        summary, results = asyncio.run(run_load(cluster.base_urls, cluster.api_key, None, jobs, 4, None,
                                                30.0, "smoke", cluster.replica_urls))
    assert summary.ok == 12, summary.first_error
    assert all(r.ttft is not None and r.e2e >= r.ttft and r.completion_tokens == 4 for r in results)
    assert summary.cached_ratio > 0.3  # 2 tenants, 64-token system prompts: mostly cached
    assert len(summary.replicas) == 2 and sum(r.requests for r in summary.replicas) == 12
