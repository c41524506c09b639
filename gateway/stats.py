"""What the admin API and dashboard show: the last N routing decisions with their explanation,
and per-interval time series (requests, cached tokens predicted vs reported, TTFT)."""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field

BUCKET_S = 2.0
BUCKETS_KEPT = 300  # ten minutes


@dataclass(slots=True)
class DecisionRecord:
    request_id: str
    ts: float
    model: str
    endpoint: str
    replica: str
    policy: str
    reason: str
    prompt_tokens: int
    predicted_cached_tokens: int
    scores: list[dict]
    attempt: int = 1
    status: int | None = None
    engine_cached_tokens: int | None = None
    ttft_s: float | None = None
    error: str | None = None
    priority: int = 0
    prefill_replica: str | None = None  # a P/D pair's prefill side (`replica` decodes)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class ReplicaBucket:
    requests: int = 0
    prompt_tokens: int = 0  # of requests whose usage came back
    predicted_cached_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class Bucket:
    t: float
    requests: int = 0
    errors: int = 0
    ttfts: list[float] = field(default_factory=list)
    replicas: dict[str, ReplicaBucket] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class GatewayStats:
    def __init__(self, decisions_kept: int = 500) -> None:
        self.decisions: deque[DecisionRecord] = deque(maxlen=decisions_kept)
        self.buckets: deque[Bucket] = deque(maxlen=BUCKETS_KEPT)
        self.ttfts: deque[float] = deque(maxlen=2000)  # for all-time-recent percentiles
        self.totals = ReplicaBucket()
        self.total_requests = 0
        self.migrations: Counter[tuple[str, str]] = Counter()  # (cause, outcome) -> streams

    def _bucket(self) -> Bucket:
        t = time.time() // BUCKET_S * BUCKET_S
        if not self.buckets or self.buckets[-1].t != t:
            self.buckets.append(Bucket(t))
        return self.buckets[-1]

    def record_decision(self, record: DecisionRecord) -> None:
        self.decisions.append(record)

    def record_request(self, replica: str | None, ok: bool) -> None:
        bucket = self._bucket()
        bucket.requests += 1
        self.total_requests += 1
        if not ok:
            bucket.errors += 1
        if replica is not None:
            bucket.replicas.setdefault(replica, ReplicaBucket()).requests += 1

    def record_migration(self, cause: str, outcome: str) -> None:
        self.migrations[(cause, outcome)] += 1

    def record_ttft(self, seconds: float) -> None:
        self._bucket().ttfts.append(seconds)
        self.ttfts.append(seconds)

    def record_usage(self, replica: str, prompt_tokens: int, predicted: int, cached: int) -> None:
        for row in (self._bucket().replicas.setdefault(replica, ReplicaBucket()), self.totals):
            row.prompt_tokens += prompt_tokens
            row.predicted_cached_tokens += predicted
            row.cached_tokens += cached

    def series(self, since: float = 0.0) -> list[dict]:
        out = []
        for b in self.buckets:
            if b.t < since:
                continue
            out.append({
                "t": b.t, "requests": b.requests, "errors": b.errors,
                "rps": b.requests / BUCKET_S,
                "ttft_p50_s": percentile(b.ttfts, 0.5), "ttft_p99_s": percentile(b.ttfts, 0.99),
                "replicas": {name: _rates(r) for name, r in b.replicas.items()},
            })
        return out

    def request_rate(self, window_s: float = 10.0) -> float:
        """Requests per second over the last `window_s` (whole buckets)."""
        since = time.time() - window_s
        return sum(b.requests for b in self.buckets if b.t + BUCKET_S > since) / window_s

    def summary(self) -> dict:
        ttfts = list(self.ttfts)
        return {
            "requests": self.total_requests,
            "request_rate_rps": self.request_rate(),
            "prompt_tokens": self.totals.prompt_tokens,
            "cached_tokens": self.totals.cached_tokens,
            "predicted_cached_tokens": self.totals.predicted_cached_tokens,
            "cached_token_ratio": _ratio(self.totals.cached_tokens, self.totals.prompt_tokens),
            "prefill_tokens_saved": self.totals.cached_tokens,
            "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p99_s": percentile(ttfts, 0.99),
            "migrations": _by_outcome(self.migrations),
        }


def _by_outcome(counts: Counter[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """{outcome: {cause: streams}}: streams broken mid-way, and what became of them."""
    out: dict[str, dict[str, int]] = {}
    for (cause, outcome), n in sorted(counts.items()):
        out.setdefault(outcome, {})[cause] = n
    return out


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _rates(r: ReplicaBucket) -> dict:
    return {"requests": r.requests, "prompt_tokens": r.prompt_tokens,
            "predicted_cached_tokens": r.predicted_cached_tokens, "cached_tokens": r.cached_tokens,
            "predicted_hit_rate": _ratio(r.predicted_cached_tokens, r.prompt_tokens),
            "actual_hit_rate": _ratio(r.cached_tokens, r.prompt_tokens)}
