"""docs/reference/metrics.md names every metric family the replica server and the gateway export."""

from __future__ import annotations

import re

from tests.docs.docs_paths import DOCS, ROOT

METRICS_PAGE = DOCS / "reference" / "metrics.md"
# What Prometheus appends to a family name on the wire.
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def source_families(*folders: str) -> set[str]:
    text = "\n".join(p.read_text() for folder in folders for p in (ROOT / folder).glob("*.py"))
    return {family(m) for m in re.findall(r"[\"'](kvgate_[a-z0-9_]*[a-z0-9])[\"']", text)}  # not prefixes


def gateway_registry_families() -> set[str]:
    from gateway.metrics import GatewayMetrics

    return {family(metric.name) for metric in GatewayMetrics().registry.collect()}


def test_every_exported_metric_is_documented():
    exported = source_families("backend_engine/server", "gateway") | gateway_registry_families()
    assert len(exported) > 40
    documented = {family(m) for m in re.findall(r"kvgate_[a-z0-9_]+", METRICS_PAGE.read_text())}
    missing = sorted(exported - documented)
    assert not missing, f"add these metrics to docs/reference/metrics.md: {missing}"
