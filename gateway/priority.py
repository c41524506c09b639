"""Request priority at the gateway (vLLM's convention: lower is served earlier, 0 by default).

A request's effective priority is its own `priority`, else its key's default; a key with
`max_priority` may not ask for anything more urgent (a smaller value): such a request is a 400,
never silently clamped, so a batch client learns at once that it cannot jump the queue. The
effective priority is routed with (the policy counts only load of equal or higher priority)
and forwarded to the replica. Per-priority counts feed the admin API, metrics and dashboard."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.config import ApiKey
from gateway.stats import percentile
from protocol.errors import bad_request

MAX_CLASSES = 16  # distinct priorities tracked one by one; the rest share "other"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def effective_priority(key: ApiKey | None, requested: int | None) -> int:
    if requested is None:
        return key.priority if key is not None else 0
    if key is not None and key.max_priority is not None and requested < key.max_priority:
        raise bad_request(
            f"Key '{key.name}' may not ask for priority {requested}: its most urgent allowed "
            f"priority is {key.max_priority} (lower values are served first).",
            "priority", "invalid_value")
    return requested


@dataclass(slots=True)
class PriorityClass:
    requests: int = 0
    ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=1000))


class PriorityStats:
    """Requests and TTFT by priority class, for /admin/api/priorities and Prometheus."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.classes: dict[str, PriorityClass] = {}
        self.requests = Counter("kvgate_gateway_requests_by_priority_total",
                                "Requests routed, by effective priority", ["priority"],
                                registry=registry)
        self.ttft = Histogram("kvgate_gateway_time_to_first_token_by_priority_seconds",
                              "Until the first body byte, by effective priority", ["priority"],
                              buckets=TTFT_BUCKETS, registry=registry)

    def label(self, priority: int) -> str:
        label = str(priority)
        if label in self.classes or len(self.classes) < MAX_CLASSES:
            return label
        return "other"

    def _class(self, priority: int) -> tuple[str, PriorityClass]:
        label = self.label(priority)
        return label, self.classes.setdefault(label, PriorityClass())

    def record_request(self, priority: int) -> None:
        label, row = self._class(priority)
        row.requests += 1
        self.requests.labels(label).inc()

    def record_ttft(self, priority: int, seconds: float) -> None:
        label, row = self._class(priority)
        row.ttfts.append(seconds)
        self.ttft.labels(label).observe(seconds)

    def summary(self, in_flight: dict[int, int]) -> list[dict]:
        """One row per priority class, most urgent first."""
        open_by_label: dict[str, int] = {}
        for priority, count in in_flight.items():
            label = self.label(priority)
            open_by_label[label] = open_by_label.get(label, 0) + count
        labels = set(self.classes) | set(open_by_label)
        rows = []
        for label in sorted(labels, key=lambda x: (x == "other", int(x) if x != "other" else 0)):
            row = self.classes.get(label, PriorityClass())
            ttfts = list(row.ttfts)
            rows.append({"priority": label, "requests": row.requests,
                         "in_flight": open_by_label.get(label, 0),
                         "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99)})
        return rows
