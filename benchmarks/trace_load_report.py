"""Per-server figures of a trace replay (finished, goodput, rates, latency percentiles) and its
plots: the TTFT CDF and output tokens per second over time."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.serve_bench_client import RequestResult
from benchmarks.serve_bench_stats import percentile


@dataclass(slots=True)
class SLO:
    ttft_s: float = 10.0
    mean_itl_s: float = 0.25

    def met(self, r: RequestResult) -> bool:
        if not r.ok or r.ttft is None or r.ttft > self.ttft_s:
            return False
        tpot = r.tpot  # the request's mean inter-token latency (None for one-token outputs)
        return tpot is None or tpot <= self.mean_itl_s


@dataclass(slots=True)
class ServerFigures:
    server: str
    requests: int
    finished: int
    goodput: int  # finished within the SLO
    goodput_per_s: float
    elapsed_s: float  # first arrival to the last token (or the window's end)
    out_tok_s: float  # output tokens of finished requests per second
    streamed_tok_s: float  # every token streamed, finished or not, per second
    prompt_tok_s: float  # prompt tokens of finished requests per second
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    cached_ratio: float | None
    errors: dict

    def to_dict(self) -> dict:
        return asdict(self)


def figures(server: str, results: list[RequestResult], window_s: float, slo: SLO) -> ServerFigures:
    done = [r for r in results if r.ok]
    last = max((t for r in results for t in r.token_times), default=0.0)
    elapsed = max(min(last, window_s), 1e-9)
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = r.error.split(":")[0][:60] or "unknown"
            errors[key] = errors.get(key, 0) + 1
    itl = [x for r in done for x in r.itl]
    good = sum(slo.met(r) for r in done)
    ttft = [r.ttft for r in done if r.ttft is not None]
    return ServerFigures(
        server=server, requests=len(results), finished=len(done), goodput=good,
        goodput_per_s=round(good / elapsed, 4), elapsed_s=round(elapsed, 1),
        out_tok_s=round(sum(r.completion_tokens for r in done) / elapsed, 2),
        streamed_tok_s=round(sum(len(r.token_times) for r in results) / elapsed, 2),
        prompt_tok_s=round(prompt / elapsed, 1),
        ttft_p50_s=_round(percentile(ttft, 50), 3), ttft_p99_s=_round(percentile(ttft, 99), 3),
        itl_p50_ms=_round(_ms(percentile(itl, 50)), 1),
        itl_p99_ms=_round(_ms(percentile(itl, 99)), 1),
        cached_ratio=round(cached / prompt, 4) if prompt else None, errors=errors)


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000


def _round(v: float | None, digits: int) -> float | None:
    return None if v is None else round(v, digits)


def table(rows: list[ServerFigures]) -> str:
    head = ("| server | finished | goodput | out tok/s | prompt tok/s | TTFT p50 / p99 (s) "
            "| ITL p50 / p99 (ms) | cached |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for f in rows:
        lines.append(f"| {f.server} | {f.finished} / {f.requests} | {f.goodput} | {f.out_tok_s} "
                     f"| {f.prompt_tok_s} | {f.ttft_p50_s} / {f.ttft_p99_s} "
                     f"| {f.itl_p50_ms} / {f.itl_p99_ms} | {f.cached_ratio} |")
    return "\n".join(lines)


def plot(path: Path, runs: dict[str, list[RequestResult]], window_s: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, rate) = plt.subplots(1, 2, figsize=(12, 4.5))
    for server, results in runs.items():
        ttft = sorted(r.ttft for r in results if r.ok and r.ttft is not None)
        n = len(results)
        cdf.step(ttft, [(i + 1) / n for i in range(len(ttft))], where="post", label=server)
        bins = [0] * (int(window_s) + 1)
        for r in results:
            for t in r.token_times:
                if t < window_s:
                    bins[int(t)] += 1
        rate.plot(range(len(bins)), bins, label=server, linewidth=1)
    cdf.set(xlabel="TTFT (s)", ylabel="share of all requests", title="TTFT CDF (finished)")
    rate.set(xlabel="time since the first arrival (s)", ylabel="output tokens/s",
             title="tokens streamed per second")
    for ax in (cdf, rate):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
