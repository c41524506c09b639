"""deploy/grafana/kvgate-dashboard.json parses, and every metric its queries name is one the
code exports: replica names from the engine server's sources, gateway names from the
gateway's metric registry."""

from __future__ import annotations

import json
import re

import pytest

from tests.deploy.deploy_paths import DEPLOY, ROOT

DASHBOARD = DEPLOY / "grafana" / "kvgate-dashboard.json"
METRIC = re.compile(r"\bkvgate_[a-z0-9_]+")
# What Prometheus appends to a family name on the wire.
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def family(series: str) -> str:
    for suffix in SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


def replica_families() -> set[str]:
    text = "\n".join(p.read_text() for p in (ROOT / "backend_engine" / "server").glob("*.py"))
    return {family(m) for m in re.findall(r"[\"'](kvgate_[a-z0-9_]+)[\"']", text)}


def gateway_families() -> set[str]:
    from gateway.metrics import GatewayMetrics

    # collect() yields every family, labelled ones too before they have any sample.
    return {family(metric.name) for metric in GatewayMetrics().registry.collect()}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def expressions(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_is_grafana_json_with_unique_panel_ids(dashboard: dict):
    ids = [p["id"] for p in dashboard["panels"]]
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36 and len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"


def test_every_query_names_an_exported_metric(dashboard: dict):
    exported = replica_families() | gateway_families()
    used = {m for expr in expressions(dashboard) for m in METRIC.findall(expr)}
    unknown = sorted(m for m in used if family(m) not in exported)
    assert not unknown, f"dashboard queries metrics nobody exports: {unknown}"


def test_histogram_quantiles_read_bucket_series(dashboard: dict):
    for expr in expressions(dashboard):
        if "histogram_quantile" in expr:
            assert re.search(r"kvgate_[a-z0-9_]+_bucket\b", expr), expr


def test_dashboard_covers_cache_latency_load_and_routing(dashboard: dict):
    used = {m for expr in expressions(dashboard) for m in METRIC.findall(expr)}
    wanted = {"kvgate_prefix_cache_queries_tokens_total", "kvgate_prefix_cache_hits_tokens_total",
              "kvgate_time_to_first_token_seconds_bucket", "kvgate_num_requests_running",
              "kvgate_num_requests_waiting", "kvgate_kv_cache_usage_ratio",
              "kvgate_gateway_requests_total", "kvgate_gateway_engine_cached_tokens_total"}
    assert wanted <= used


def test_metric_check_catches_an_unknown_name():
    assert family("kvgate_prefix_cache_hit_tokens_total") not in replica_families() | gateway_families()
