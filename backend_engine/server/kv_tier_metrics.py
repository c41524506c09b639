"""Prometheus metrics of the KV tier below the block pool (`--kv-offload-size`,
`--kv-offload-dir`), read from the engine's load report at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

RESTORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def kv_tier_metrics(tier: dict) -> Iterator[Metric]:
    hits = CounterMetricFamily("kvgate_kv_tier_hits_tokens",
                               "Prompt tokens restored from the KV tier instead of prefilled, by "
                               "level.", labels=["level"])
    for level, tokens in sorted(tier.get("hit_tokens_by_level", {}).items()):
        hits.add_metric([level], float(tokens))
    yield hits
    yield CounterMetricFamily("kvgate_kv_tier_misses_tokens",
                              "Prompt tokens a request's first lookup found in neither the pool "
                              "nor the KV tier.", value=float(tier.get("miss_tokens", 0)))
    used = GaugeMetricFamily("kvgate_kv_tier_usage_bytes", "Bytes the KV tier holds, by level.",
                             labels=["level"])
    capacity = GaugeMetricFamily("kvgate_kv_tier_capacity_bytes", "The KV tier's bound, by level.",
                                 labels=["level"])
    for level in ("ram", "disk"):
        if f"{level}_bytes" in tier:
            used.add_metric([level], float(tier[f"{level}_bytes"]))
            capacity.add_metric([level], float(tier[f"{level}_capacity_bytes"]))
    yield used
    yield capacity
    for key, name, doc in (
        ("offloaded_blocks", "kvgate_kv_tier_offloaded_blocks",
         "Blocks copied into the KV tier when the pool evicted them."),
        ("restored_blocks", "kvgate_kv_tier_restored_blocks", "Blocks copied back into the pool."),
        ("corrupt_files", "kvgate_kv_tier_corrupt_files",
         "Disk tier files dropped: truncated, foreign or failing their checksum."),
        ("write_failures", "kvgate_kv_tier_write_failures", "Disk tier writes that failed."),
        ("dropped_writes", "kvgate_kv_tier_dropped_writes",
         "Blocks not written to disk because the write backlog was full."),
        ("read_seconds_total", "kvgate_kv_tier_read_seconds",
         "Time the disk tier's reader thread spent reading blocks requests waited for."),
    ):
        if key in tier:
            yield CounterMetricFamily(name, doc, value=float(tier[key]))
    if "write_backlog" in tier:
        yield GaugeMetricFamily("kvgate_kv_tier_write_backlog_blocks",
                                "Blocks queued for the disk tier's writer thread.",
                                value=float(tier["write_backlog"]))
    if "read_blocks" in tier:
        yield GaugeMetricFamily("kvgate_kv_tier_read_blocks",
                                "Disk tier blocks being read (or read) for requests waiting "
                                "for them.", value=float(tier["read_blocks"]))
    if "restore_cost" in tier:
        yield GaugeMetricFamily("kvgate_kv_tier_restore_cost_ratio",
                                "Measured restore time per token over prefill time per token.",
                                value=float(tier["restore_cost"]))
