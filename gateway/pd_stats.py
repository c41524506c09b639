"""What the gateway sees of prefill/decode disaggregation, for /admin/api/pd, the dashboard and
Prometheus: pair decisions, prefill halves (with their transfers) in flight, bytes moved and
transfer time, how well the index predicted what the decode replica lacked, and failovers."""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter as PromCounter, Gauge, Histogram

from gateway.stats import percentile

TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclass(slots=True)
class Transfer:
    ts: float
    prefill: str
    decode: str
    blocks_predicted: int  # what the gateway's index said the decode replica lacked
    blocks_needed: int  # what it actually lacked
    blocks_sent: int
    bytes: int
    seconds: float  # what the transfer added: prefill's end to the decode replica's acknowledgement
    prefill_seconds: float  # the whole prefill half, as the gateway saw it


@dataclass
class PDStats:
    registry: CollectorRegistry
    in_flight: int = 0  # prefill halves under way (prefill computing and blocks moving)
    decisions: Counter = field(default_factory=Counter)  # "pair" | "bypass" | "no_prefill_replica"
    failures: Counter = field(default_factory=Counter)  # by reason, before the first byte
    fallbacks: int = 0  # requests that left P/D for a whole-request replica
    bytes: int = 0
    blocks: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=1000))

    def __post_init__(self) -> None:
        p, r = "kvgate_gateway_pd_", self.registry
        self._decisions = PromCounter(p + "decisions_total", "P/D routing outcomes", ["kind"], registry=r)
        self._failures = PromCounter(p + "failures_total", "P/D attempts that failed before the first byte",
                                     ["reason"], registry=r)
        self._fallbacks = PromCounter(p + "fallbacks_total", "Requests moved from P/D to a whole-request replica",
                                      registry=r)
        self._in_flight = Gauge(p + "transfers_in_flight", "Prefill halves (and their KV transfers) under way",
                                registry=r)
        self._bytes = PromCounter(p + "transfer_bytes_total", "KV bytes moved between replicas", registry=r)
        self._seconds = Histogram(p + "transfer_seconds",
                                  "KV transfer time a request waited after its prefill",
                                  buckets=TRANSFER_BUCKETS, registry=r)

    def decided(self, kind: str) -> None:
        self.decisions[kind] += 1
        self._decisions.labels(kind).inc()

    def started(self) -> None:
        self.in_flight += 1
        self._in_flight.set(self.in_flight)

    def ended(self) -> None:
        self.in_flight -= 1
        self._in_flight.set(self.in_flight)

    def failed(self, reason: str) -> None:
        self.failures[reason] += 1
        self._failures.labels(reason).inc()

    def fell_back(self) -> None:
        self.fallbacks += 1
        self._fallbacks.inc()

    def transferred(self, transfer: Transfer) -> None:
        self.recent.append(transfer)
        self.bytes += transfer.bytes
        self.blocks += transfer.blocks_sent
        self._bytes.inc(transfer.bytes)
        self._seconds.observe(transfer.seconds)

    def summary(self, window_s: float = 60.0) -> dict:
        rows = list(self.recent)
        seconds = [t.seconds for t in rows]
        since = time.time() - window_s
        last = [t for t in rows if t.ts >= since]
        predicted = sum(t.blocks_predicted for t in rows)
        return {
            "decisions": dict(self.decisions), "failures": dict(self.failures),
            "fallbacks": self.fallbacks, "transfers_in_flight": self.in_flight,
            "transfer_bytes": self.bytes, "transfer_blocks": self.blocks,
            "transfer_bytes_per_s": sum(t.bytes for t in last) / window_s,
            "transfer_p50_s": percentile(seconds, 0.5), "transfer_p99_s": percentile(seconds, 0.99),
            "prefill_half_p50_s": percentile([t.prefill_seconds for t in rows], 0.5),
            # how well the index knew what the decode replica lacked (1.0: exactly)
            "transfer_prediction_ratio": (sum(t.blocks_needed for t in rows) / predicted
                                          if predicted else None),
            "recent": [{"ts": t.ts, "prefill": t.prefill, "decode": t.decode, "blocks": t.blocks_sent,
                        "bytes": t.bytes, "seconds": round(t.seconds, 4)} for t in rows[-20:]],
        }
