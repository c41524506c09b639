"""Summaries of a run: latency percentiles, throughput, cached-token ratio, and the per-replica
spread read from the replicas' Prometheus `/metrics` (or a gateway's `/admin/api/replicas`)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import httpx

from benchmarks.serve_bench_client import RequestResult


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def pcts(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


@dataclass(slots=True)
class ReplicaStats:
    name: str
    requests: float = 0.0
    prompt_tokens: float = 0.0  # looked up in the prefix cache
    cached_tokens: float = 0.0  # found there

    @property
    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass(slots=True)
class Summary:
    label: str
    requests: int
    ok: int
    errors: int
    elapsed_s: float
    req_per_s: float
    prompt_tok_per_s: float
    output_tok_per_s: float
    cached_ratio: float  # cached / prompt tokens over successful requests
    ttft: dict
    tpot: dict
    itl: dict
    e2e: dict
    replicas: list[ReplicaStats] = field(default_factory=list)
    first_error: str = ""

    @property
    def spread(self) -> float | None:
        """Busiest replica's requests over the mean: 1.0 is perfectly even."""
        counts = [r.requests for r in self.replicas]
        mean = sum(counts) / len(counts) if counts else 0
        return max(counts) / mean if mean else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["replicas"] = [{**asdict(r), "hit_rate": r.hit_rate} for r in self.replicas]
        d["spread_max_over_mean"] = self.spread
        return d


def summarize(label: str, results: list[RequestResult], elapsed: float,
              replicas: list[ReplicaStats] | None = None) -> Summary:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out = sum(r.completion_tokens for r in ok)
    elapsed = max(elapsed, 1e-9)
    errs = [r.error for r in results if not r.ok]
    return Summary(
        label=label, requests=len(results), ok=len(ok), errors=len(results) - len(ok), elapsed_s=elapsed,
        req_per_s=len(ok) / elapsed, prompt_tok_per_s=prompt / elapsed, output_tok_per_s=out / elapsed,
        cached_ratio=cached / prompt if prompt else 0.0,
        ttft=pcts([r.ttft for r in ok if r.ttft is not None]),
        tpot=pcts([t for r in ok if (t := r.tpot) is not None]),
        itl=pcts([x for r in ok for x in r.itl]),
        e2e=pcts([r.e2e for r in ok if r.e2e is not None]),
        replicas=replicas or [], first_error=errs[0] if errs else "")


# ---- per-replica counters ------------------------------------------------------------------

_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN|[+-]Inf)\s*$")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of each metric over its label sets (enough for the counters read here)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


async def replica_counters(urls: list[str]) -> list[ReplicaStats]:
    """Cumulative prefix-cache and request counters of each replica (`/metrics` is keyless)."""
    stats = []
    async with httpx.AsyncClient(timeout=5.0) as c:
        for i, url in enumerate(urls):
            try:
                m = parse_prometheus((await c.get(url.rstrip("/") + "/metrics")).text)
            except httpx.HTTPError:
                m = {}
            stats.append(ReplicaStats(
                f"replica-{i + 1}",
                m.get("kvgate_request_success_total", 0.0),
                m.get("kvgate_prefix_cache_queries_tokens_total", 0.0),
                m.get("kvgate_prefix_cache_hits_tokens_total", 0.0)))
    return stats


def delta(after: list[ReplicaStats], before: list[ReplicaStats]) -> list[ReplicaStats]:
    """Counters over one run, when the replicas served earlier runs too."""
    return [ReplicaStats(a.name, a.requests - b.requests, a.prompt_tokens - b.prompt_tokens,
                         a.cached_tokens - b.cached_tokens) for a, b in zip(after, before)]


async def gateway_replicas(gateway_urls: list[str], admin_key: str) -> list[ReplicaStats]:
    """Per-replica counts the gateways observed (summed over gateways), from `/admin/api`:
    the fallback when the replicas' own /metrics are not reachable."""
    by_name: dict[str, ReplicaStats] = {}
    async with httpx.AsyncClient(timeout=5.0, headers={"Authorization": f"Bearer {admin_key}"}) as c:
        for url in gateway_urls:
            try:
                data = (await c.get(url.rstrip("/") + "/admin/api/replicas")).json()["data"]
            except (httpx.HTTPError, ValueError, KeyError):
                continue
            for r in data:
                s = by_name.setdefault(r["name"], ReplicaStats(r["name"]))
                s.requests += r.get("requests", 0)
                s.prompt_tokens += r.get("prompt_tokens", 0)
                s.cached_tokens += r.get("cached_tokens", 0)
    return list(by_name.values())


def format_summary(s: Summary) -> str:
    def ms(d: dict) -> str:
        return " / ".join("-" if v is None else f"{v * 1000:.0f}" for v in d.values())

    lines = [f"[{s.label}] {s.ok}/{s.requests} ok in {s.elapsed_s:.1f}s: {s.req_per_s:.2f} req/s, "
             f"{s.prompt_tok_per_s:.0f} prompt tok/s, {s.output_tok_per_s:.1f} output tok/s, "
             f"cached ratio {s.cached_ratio:.3f}",
             f"  TTFT p50/p90/p99 ms {ms(s.ttft)} · TPOT {ms(s.tpot)} · ITL {ms(s.itl)} · e2e {ms(s.e2e)}"]
    if s.replicas:
        parts = [f"{r.name} {r.requests:.0f} req hit {'-' if r.hit_rate is None else f'{r.hit_rate:.2f}'}"
                 for r in s.replicas]
        spread = "-" if s.spread is None else f"{s.spread:.2f}"
        lines.append("  replicas: " + ", ".join(parts) + f" (max/mean {spread})")
    if s.first_error:
        lines.append(f"  first error: {s.first_error}")
    return "\n".join(lines)
