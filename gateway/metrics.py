"""Prometheus metrics of one gateway process (`kvgate_gateway_…`), in their own registry so a
gateway and a replica can share a process in tests. Gauges are refreshed at scrape time."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.circuit import STATE_CODES
from gateway.kv_feed_metrics import KvFeedCollector
from gateway.prefix_advice import PrefixAdvisor
from gateway.prefix_advice_metrics import PrefixAdviceMetrics
from gateway.replicas import HEALTHY, Replica
from routing.index import IndexSize
from routing.redis_store import StoreState

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TOKEN_BUCKETS = (-4096, -1024, -256, -64, -16, 0, 16, 64, 256, 1024, 4096)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "kvgate_gateway_"
        self.requests = Counter(p + "requests_total", "Requests answered, by replica and status",
                                ["endpoint", "replica", "status"], registry=r)
        self.decisions = Counter(p + "routing_decisions_total", "Routing decisions",
                                 ["policy", "reason"], registry=r)
        self.predicted_cached = Counter(p + "predicted_cached_tokens_total",
                                        "Cached prompt tokens the router predicted", ["replica"], registry=r)
        self.engine_cached = Counter(p + "engine_cached_tokens_total",
                                     "Cached prompt tokens the engine reported", ["replica"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens of answered requests",
                                     ["replica"], registry=r)
        self.prediction_error = Histogram(p + "cached_tokens_prediction_error_tokens",
                                          "Predicted minus engine-reported cached tokens per request",
                                          buckets=TOKEN_BUCKETS, registry=r)
        self.routing_latency = Histogram(p + "routing_latency_seconds", "Tokenise + hash + route",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_latency = Histogram(p + "upstream_latency_seconds",
                                          "Until the replica's response headers", ["replica"],
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Until the first body byte",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.retries = Counter(p + "retries_total", "Attempts moved to another replica", ["reason"],
                               registry=r)
        self.queued = Gauge(p + "overload_queue_requests",
                            "Requests waiting because every replica refused them for load", registry=r)
        self.overload_refused = Counter(p + "overload_refused_total",
                                        "Requests answered 503 by the overload queue (full, timeout)",
                                        ["reason"], registry=r)
        self.rate_limited = Counter(p + "rate_limited_total", "Requests refused by rate limits",
                                    ["key"], registry=r)
        self.stream_errors = Counter(p + "stream_errors_total",
                                     "Streams ended by an upstream failure after the first byte",
                                     ["replica"], registry=r)
        self.migrations = Counter(p + "migrations_total",
                                  "Streams whose replica failed mid-way, by cause (disconnect, "
                                  "error, drain, down, stall) and outcome (continued on another "
                                  "replica, limit_reached, no_replica, not_needed)",
                                  ["cause", "outcome"], registry=r)
        self.circuit = Gauge(p + "circuit_state", "0 closed, 1 half-open, 2 open", ["replica"], registry=r)
        self.up = Gauge(p + "replica_up", "1 when the replica's health check passes", ["replica"], registry=r)
        self.routable = Gauge(p + "replica_routable", "1 when new requests may go there", ["replica"], registry=r)
        self.in_flight = Gauge(p + "in_flight_requests", "Requests this gateway has open", ["replica"], registry=r)
        self.index_entries = Gauge(p + "index_entries", "Prefix index entries", ["kind"], registry=r)
        self.index_bytes = Gauge(p + "index_bytes", "Estimated prefix index memory", registry=r)
        self.pins = Gauge(p + "pinned_prefixes", "Pinned prefixes this gateway knows", registry=r)
        self.pin_pushes = Counter(p + "pin_pushes_total", "Pins pushed to replicas, by outcome",
                                  ["outcome"], registry=r)
        self.redis_state = Gauge(p + "redis_state", "1 for the current shared-state mode", ["state"], registry=r)
        self.prefix_advice = PrefixAdviceMetrics(r, p)
        self.kv_feeds = KvFeedCollector(r, p)

    def render(self, replicas: Collection[Replica], in_flight: Mapping[str, int], queued: int,
               index: IndexSize, pins: int, redis: StoreState,
               advice: PrefixAdvisor | None) -> bytes:
        """The exposition text, with the gauges set from these readings of the gateway's state."""
        for replica in replicas:
            self.circuit.labels(replica.name).set(STATE_CODES[replica.breaker.state])
            self.up.labels(replica.name).set(1 if replica.health == HEALTHY else 0)
            self.routable.labels(replica.name).set(1 if replica.routable() else 0)
        for name, count in in_flight.items():
            self.in_flight.labels(name).set(count)
        self.queued.set(queued)
        self.index_entries.labels("resident").set(index.resident_entries)
        self.index_entries.labels("predicted").set(index.predicted_entries)
        self.index_bytes.set(index.estimated_bytes)
        self.pins.set(pins)
        for mode in StoreState:
            self.redis_state.labels(mode.value).set(1 if mode is redis else 0)
        self.prefix_advice.refresh(advice)
        self.kv_feeds.replicas = replicas
        return generate_latest(self.registry)

    def forget_replica(self, name: str) -> None:
        for gauge in (self.circuit, self.up, self.routable, self.in_flight):
            try:
                gauge.remove(name)
            except KeyError:
                pass
