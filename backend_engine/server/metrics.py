"""Prometheus metrics, names prefixed `kvgate_`, base units (tokens, seconds, ratios).

Counters and gauges are read from the engine at scrape time (no double bookkeeping); latency
histograms are fed from the engine's observations, drained at scrape time and every second.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backend_engine.server.kv_tier_metrics import RESTORE_BUCKETS, kv_tier_metrics
from protocol.engine_extras import IGNORED

if TYPE_CHECKING:
    from backend_engine.server.state import ServerState

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
MAX_PRIORITY_LABELS = 16
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
KV_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
GRAMMAR_MASK_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)

_ENGINE_COUNTERS = (
    ("prefix_cache_queries", "kvgate_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "kvgate_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache."),
    ("preemptions", "kvgate_num_preemptions", "Requests preempted for lack of KV blocks."),
    ("prompt_tokens", "kvgate_prompt_tokens", "Prompt tokens processed."),
    ("generation_tokens", "kvgate_generation_tokens", "Tokens generated."),
    ("admission_refused", "kvgate_admission_refused",
     "Requests refused with 503 because the queue could not meet max_queue_delay_s."),
)
_SPEC_COUNTERS = (
    ("drafted_tokens", "kvgate_spec_decode_draft_tokens", "Speculative tokens proposed."),
    ("accepted_tokens", "kvgate_spec_decode_accepted_tokens", "Speculative tokens accepted."),
    ("emitted_tokens", "kvgate_spec_decode_emitted_tokens",
     "Tokens emitted by verification steps (accepted drafts plus one bonus token each)."),
    ("verifications", "kvgate_spec_decode_verifications", "Sequence-steps that verified drafts."),
)

_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/tokenize", "/detokenize", "/health",
           "/metrics", "/kv/snapshot", "/kv/events", "/admin/pins", "/tokenizer/bundle"}


class _EngineCollector(Collector):
    def __init__(self, state: "ServerState"):
        self.state = state

    def collect(self) -> Iterator[Metric]:
        engine = self.state.engine
        up = GaugeMetricFamily("kvgate_engine_ready", "1 when the replica accepts requests.")
        up.add_metric([], 1.0 if self.state.phase == "ready" else 0.0)
        yield up
        yield _ignored_fields()
        if engine is None:
            return
        stats = engine.stats
        for attr, name, doc in _ENGINE_COUNTERS:
            if hasattr(stats, attr):
                yield CounterMetricFamily(name, doc, value=float(getattr(stats, attr)))
        yield from _spec_metrics(getattr(engine, "spec_stats", None))
        outcomes = CounterMetricFamily("kvgate_request_success", "Finished requests by finish reason.",
                                       labels=["finished_reason"])
        for reason, count in sorted(getattr(stats, "finished_by_reason", {}).items()):
            outcomes.add_metric([reason], float(count))
        yield outcomes
        pins = getattr(engine, "pins", None)
        if pins is not None:
            yield GaugeMetricFamily("kvgate_pinned_prefixes", "Prefixes pinned on this replica.",
                                    value=float(len(pins())))
        load = engine.load()
        for key, name, doc in (
            ("running", "kvgate_num_requests_running", "Requests in the running batch."),
            ("waiting", "kvgate_num_requests_waiting", "Requests waiting to be scheduled."),
            ("kv_usage", "kvgate_kv_cache_usage_ratio", "Fraction of KV blocks held by requests (0-1)."),
            ("pending_prefill_tokens", "kvgate_pending_prefill_tokens", "Prompt tokens not yet prefilled."),
            ("num_free_blocks", "kvgate_kv_cache_free_blocks", "KV blocks not held by a running request."),
            ("num_total_blocks", "kvgate_kv_cache_total_blocks", "KV blocks in the pool."),
            ("pinned_blocks", "kvgate_kv_cache_pinned_blocks", "KV blocks held by pinned prefixes."),
            ("max_pinned_blocks", "kvgate_kv_cache_pinned_capacity_blocks",
             "KV blocks pinned prefixes may hold (max_pinned_fraction of the pool)."),
            ("queue_delay_s", "kvgate_queue_delay_estimate_seconds",
             "Expected wait before a request arriving now gets its first token."),
            ("drain_rate_tok_s", "kvgate_queue_drain_rate_tokens_per_second",
             "Prefill tokens per second the waiting queue is retired at (measured or modelled)."),
            ("target_itl_s", "kvgate_target_inter_token_latency_seconds",
             "The step budget's inter-token latency target (absent: fixed token budget)."),
            ("prefill_floor_tokens", "kvgate_prefill_floor_tokens",
             "Prefill tokens a step carries at the least while prompts wait (amortises a "
             "step's fixed prefill cost)."),
        ):
            if key in load:
                yield GaugeMetricFamily(name, doc, value=float(load[key]))
        yield _by_priority(load.get("by_priority") or {})
        if load.get("kv_transfer"):
            yield from _kv_transfer_metrics(load["kv_transfer"])
        if load.get("kv_tier"):
            yield from kv_tier_metrics(load["kv_tier"])


def _kv_transfer_metrics(kv: dict) -> Iterator[Metric]:
    """Prefill/decode disaggregation: this replica's role and its transfers."""
    role = GaugeMetricFamily("kvgate_replica_role", "1 for this replica's P/D role.", labels=["role"])
    role.add_metric([kv.get("role", "both")], 1.0)
    yield role
    yield GaugeMetricFamily("kvgate_kv_transfers_in_flight", "KV transfers under way.",
                            value=float(kv.get("in_flight", 0)))
    yield GaugeMetricFamily("kvgate_kv_transfer_held_blocks",
                            "KV blocks held by transfers (being sent, filled, or awaiting their request).",
                            value=float(kv.get("held_blocks", 0)))
    blocks = CounterMetricFamily("kvgate_kv_transfer_blocks", "KV blocks moved.", labels=["direction"])
    moved = CounterMetricFamily("kvgate_kv_transfer_bytes", "KV bytes moved.", labels=["direction"])
    for direction in ("sent", "received"):
        if f"blocks_{direction}" in kv:
            blocks.add_metric([direction], float(kv[f"blocks_{direction}"]))
            moved.add_metric([direction], float(kv[f"bytes_{direction}"]))
    yield blocks
    yield moved
    outcomes = CounterMetricFamily("kvgate_kv_transfers", "Finished KV transfers by outcome.", labels=["outcome"])
    for outcome, count in sorted((kv.get("transfers") or {}).items()):
        outcomes.add_metric([outcome], float(count))
    if "transfers_failed" in kv:
        outcomes.add_metric(["receive_failed"], float(kv["transfers_failed"]))
        yield CounterMetricFamily("kvgate_kv_transfer_checksum_failures",
                                  "Received blocks whose checksum did not match.",
                                  value=float(kv.get("checksum_failures", 0)))
    yield outcomes


def _ignored_fields() -> Metric:
    family = CounterMetricFamily("kvgate_request_ignored_fields",
                                 "Requests carrying a field of vLLM's or SGLang's schema that asks "
                                 "for nothing here (dropped), by field.", labels=["field"])
    for name, count in sorted(IGNORED.items()):
        family.add_metric([name], float(count))
    return family


def _by_priority(by_priority: dict) -> Metric:
    family = GaugeMetricFamily("kvgate_num_requests_by_priority",
                               "Sequences in the scheduler's queues, by priority and state.",
                               labels=["priority", "state"])
    for priority, row in sorted(by_priority.items(), key=lambda item: int(item[0])):
        for state in ("running", "waiting"):
            family.add_metric([priority, state], float(row[state]))
    return family


def _spec_metrics(spec) -> Iterator[Metric]:
    if spec is None:
        return
    for attr, name, doc in _SPEC_COUNTERS:
        yield CounterMetricFamily(name, doc, value=float(getattr(spec, attr)))
    yield GaugeMetricFamily("kvgate_spec_decode_acceptance_ratio",
                            "Accepted over drafted speculative tokens (0-1).",
                            value=spec.acceptance_rate)
    yield GaugeMetricFamily("kvgate_spec_decode_mean_accepted_length",
                            "Mean accepted drafts per verification.",
                            value=spec.mean_accepted_length)


class ServerMetrics:
    """One registry per app (several apps may share a process in tests)."""

    def __init__(self, state: "ServerState"):
        self.state = state
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(state))
        r = self.registry
        self.ttft = Histogram("kvgate_time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("kvgate_time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("kvgate_e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             buckets=E2E_BUCKETS, registry=r)
        self.step = Histogram("kvgate_engine_step_seconds", "Engine step time (schedule, forward, sample).",
                              buckets=STEP_BUCKETS, registry=r)
        self.ttft_by_priority = Histogram(
            "kvgate_time_to_first_token_by_priority_seconds", "Time to first token, by request priority.",
            ["priority"], buckets=TTFT_BUCKETS, registry=r)
        self.grammar_compile = Histogram(
            "kvgate_grammar_compile_seconds", "Compiling a structured-output grammar (off the step loop).",
            buckets=GRAMMAR_COMPILE_BUCKETS, registry=r)
        self.grammar_mask = Histogram(
            "kvgate_grammar_bitmask_seconds", "Filling one step's grammar bitmask (overlaps the forward pass).",
            buckets=GRAMMAR_MASK_BUCKETS, registry=r)
        self._priority_labels: set[str] = set()
        self.kv_transfer = Histogram("kvgate_kv_transfer_seconds",
                                     "What a KV transfer added to its request: from the prefill's end to the "
                                     "decode replica's acknowledgement.",
                                     buckets=KV_TRANSFER_BUCKETS, registry=r)
        self.kv_tier_restore = Histogram("kvgate_kv_tier_restore_seconds",
                                         "Restoring a prefix's blocks from the KV tier into the pool.",
                                         buckets=RESTORE_BUCKETS, registry=r)
        self.http = Counter("kvgate_http_requests", "HTTP requests by route and status code.",
                            ["route", "status_code"], registry=r)

    def drain_engine_observations(self) -> None:
        engine = self.state.engine
        if engine is None:
            return
        observed = engine.drain_observations()
        for key, histogram in (("ttft", self.ttft), ("tpot", self.tpot), ("e2e", self.e2e),
                               ("step", self.step), ("grammar_compile", self.grammar_compile),
                               ("grammar_mask", self.grammar_mask),
                               ("kv_tier_restore", self.kv_tier_restore)):
            for value in observed.get(key, ()):
                histogram.observe(value)
        for priority, value in engine.drain_ttft_by_priority():
            self.ttft_by_priority.labels(self._priority_label(priority)).observe(value)
        for value in engine.drain_kv_transfer_seconds():
            self.kv_transfer.observe(value)

    def _priority_label(self, priority: int) -> str:
        """The priority as a label; past MAX_PRIORITY_LABELS distinct values, "other" (a client
        cannot grow the series without bound)."""
        label = str(priority)
        if label not in self._priority_labels:
            if len(self._priority_labels) >= MAX_PRIORITY_LABELS:
                return "other"
            self._priority_labels.add(label)
        return label

    def render(self) -> bytes:
        self.drain_engine_observations()
        return generate_latest(self.registry)

    async def drain_forever(self, interval_s: float = 1.0) -> None:
        """Keeps the engine's observation lists short when nobody scrapes."""
        while True:
            await asyncio.sleep(interval_s)
            self.drain_engine_observations()


class HTTPMetricsMiddleware:
    """Counts responses by route and status code (a 200 stream counts when its headers go out)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in _ROUTES else ("/v1/models/{id}" if path.startswith("/v1/models/")
                                             else "/admin/pins/{id}" if path.startswith("/admin/pins/")
                                             else "/v1/requests/{id}" if path.startswith("/v1/requests/")
                                             else "other")

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
