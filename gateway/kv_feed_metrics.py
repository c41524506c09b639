"""Prometheus series of the replicas' KV event feeds, read from their counters at scrape time:
event lag (both feeds), and for ZMQ feeds the batches, bad messages, replays, restarts and the
engine blocks mapped or dropped."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.replicas import Replica

_FEED_COUNTERS = ("batches", "bad_messages", "replays", "replays_lost", "restarts", "disconnects")
_BLOCK_COUNTERS = ("stored_blocks", "removed_blocks", "unknown_parent", "unmappable", "ignored",
                   "unknown_removed", "evicted")


class KvFeedCollector:
    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.prefix = prefix
        self.replicas: Iterable[Replica] = ()
        registry.register(self)

    def collect(self) -> Iterator:
        p = self.prefix
        lag = GaugeMetricFamily(p + "kv_event_lag_seconds",
                                "Age of the last applied KV event batch, by its timestamp",
                                labels=["replica", "source"])
        feed = CounterMetricFamily(p + "kv_feed_events", "ZMQ KV event feed: batches applied, "
                                   "bad messages dropped, replays asked and lost, publisher "
                                   "restarts and disconnects", labels=["replica", "kind"])
        blocks = CounterMetricFamily(p + "kv_feed_blocks", "ZMQ KV event feed: engine blocks "
                                     "mapped, removed, or dropped (and why)",
                                     labels=["replica", "kind"])
        for replica in list(self.replicas):
            if replica.event_lag_s is not None:
                lag.add_metric([replica.name, replica.kv_source], replica.event_lag_s)
            stats = replica.kv_feed
            if stats is None:
                continue
            for kind in _FEED_COUNTERS:
                feed.add_metric([replica.name, kind], getattr(stats, kind))
            for kind in _BLOCK_COUNTERS:
                blocks.add_metric([replica.name, kind], getattr(stats.blocks, kind))
        yield lag
        yield feed
        yield blocks
