"""The soak: moderate mixed load (streaming and not, ten shared prefixes) through every gateway
for a fixed time; resident memory of each replica and gateway after a warm-up and at the end."""

from __future__ import annotations

import time

from benchmarks.reliability.cluster import LocalCluster
from benchmarks.reliability.load import Load, body
from benchmarks.reliability.result import ScenarioResult

RSS_BUDGET_MB = 50.0


def _mixed(i: int) -> dict:
    return body(i, stream=i % 3 != 0, max_tokens=24 + (i % 4) * 8, prefix="soak")


def soak(cluster: LocalCluster, duration_s: float, workers: int = 4, pause_s: float = 0.05) -> ScenarioResult:
    result = ScenarioResult(f"soak ({duration_s:.0f} s)")
    urls = [g.spec.url for g in cluster.gateways]
    warmup_s = min(30.0, duration_s / 5)
    with Load(urls, workers, _mixed, pause_s=pause_s) as load:
        time.sleep(warmup_s)
        before = cluster.rss_mb()
        time.sleep(duration_s - warmup_s)
        after = cluster.rss_mb()
    result.count(load.tally)
    result.rss_growth_mb = {name: round(after[name] - before[name], 1) for name in before if name in after}
    result.notes["requests_per_s"] = round(result.sent / duration_s, 1)
    result.checks["no request fails"] = result.failed == 0
    result.checks[f"RSS growth under {RSS_BUDGET_MB:.0f} MB"] = max(result.rss_growth_mb.values()) < RSS_BUDGET_MB
    return result
