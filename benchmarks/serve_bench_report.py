"""The `--compare-policies` report: a markdown table and two PNG plots."""

from __future__ import annotations

from pathlib import Path

from benchmarks.serve_bench_client import RequestResult
from benchmarks.serve_bench_stats import Summary


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def table(summaries: list[Summary]) -> str:
    rows = ["| run | ok/sent | req/s | out tok/s | cached ratio | TTFT p50 | TTFT p90 | TTFT p99 "
            "| TPOT p50 | e2e p50 | replica req max/mean | hit rate per replica |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        hits = " ".join(_f(r.hit_rate) for r in s.replicas) or "-"
        rows.append(f"| {s.label} | {s.ok}/{s.requests} | {s.req_per_s:.2f} | {s.output_tok_per_s:.1f} "
                    f"| {s.cached_ratio:.3f} | {_ms(s.ttft['p50'])} | {_ms(s.ttft['p90'])} | {_ms(s.ttft['p99'])} "
                    f"| {_ms(s.tpot['p50'])} | {_ms(s.e2e['p50'])} | {_f(s.spread)} | {hits} |")
    return "\n".join(rows)


def plots(out_dir: Path, prefix: str, summaries: list[Summary],
          results: dict[str, list[RequestResult]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.ticker
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, res in results.items():
        xs = sorted(r.ttft * 1000 for r in res if r.ok and r.ttft is not None)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)
    ax.set_xscale("log")
    # Plain millisecond labels; log-scale minor labels overlap at this size.
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per policy (multi-tenant, live cluster)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / f"{prefix}_ttft_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    n = len(summaries)
    width = 0.8 / max(n, 1)
    for i, s in enumerate(summaries):
        ys = [r.hit_rate or 0.0 for r in s.replicas]
        ax.bar([j + i * width for j in range(len(ys))], ys, width, label=s.label)
    k = max((len(s.replicas) for s in summaries), default=0)
    ax.set_xticks([j + width * (n - 1) / 2 for j in range(k)], [f"replica {j + 1}" for j in range(k)])
    ax.set_ylim(0, 1)
    ax.set_ylabel("prefix-cache hit rate (tokens)")
    ax.set_title("Hit rate per replica")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / f"{prefix}_hit_rate.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def markdown(command: str, setup: str, summaries: list[Summary], headline: dict, plot_paths: list[Path]) -> str:
    import json

    imgs = "\n".join(f"![{p.stem}]({p.name})" for p in plot_paths)
    return (f"# serve_bench --compare-policies\n\nCommand: `{command}`\n\n{setup}\n\n"
            f"{table(summaries)}\n\n```\n{json.dumps(headline)}\n```\n\n{imgs}\n")
