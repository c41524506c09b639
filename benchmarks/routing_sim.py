"""Routing simulator: `python -m benchmarks.routing_sim`.

K simulated replicas (LRU block caches plus a service-time model, benchmarks/sim_replica.py)
serve workloads routed by the REAL routing code (routing.Router, its index and policies), fed
by the replicas' KV events with a lag. Prints a table per workload and ends with one JSON line
of headline ratios for workload (a) at K=4 (the last from workload (d)). Writes PNG plots to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks import results_file
from benchmarks import sim_workloads as wl
from benchmarks.sim_engine import SimResult, simulate
from benchmarks.sim_foreign import run_foreign
from benchmarks.sim_replica import pooled_upper_bound
from routing.policies import REGISTRY

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO.parent / "shared" / "data" / "traces" / "mooncake_conversation_head2000_bs16.jsonl"
RESULTS = REPO / "benchmarks" / "results"
GATEWAY_CONFIGS = [(1, True), (2, True), (4, True), (2, False), (4, False)]


@dataclass(slots=True)
class Workload:
    key: str
    title: str
    requests: list
    capacity_blocks: int
    all_gateway_configs: bool = False


def build_workloads(args: argparse.Namespace) -> list[Workload]:
    bs, n = args.block_size, args.requests
    out = [
        # 24 tenants x 128-block system prompts = 3072 blocks: more than one replica's 1024,
        # less than the 4 x 1024 of all replicas together.
        Workload("a", "multi-tenant system prompts",
                 wl.multi_tenant(random.Random(args.seed), n, args.rate, bs), 1024, True),
        # The same with a few hot tenants (Zipf 1.2): affinity alone makes hot spots here.
        Workload("a2", "multi-tenant, skewed popularity (Zipf 1.2)",
                 wl.multi_tenant(random.Random(args.seed + 5), n, args.rate, bs, zipf_s=1.2), 1024),
        Workload("b", "multi-turn chats",
                 wl.multi_turn(random.Random(args.seed + 1), n, args.rate * 0.75, bs), 1024),
        Workload("c", "best-of-8 sibling bursts", wl.best_of_n(random.Random(args.seed + 2), n, args.rate, bs), 1024),
        Workload("d", "no reuse", wl.no_reuse(random.Random(args.seed + 3), n, args.rate, bs), 1024),
    ]
    trace = Path(args.trace) if args.trace else DEFAULT_TRACE
    if trace.exists():
        # The bs16 trace is ~3 req/s of short prompts; replay it 4x faster so replicas are busy.
        out.append(Workload("e", f"trace {trace.name} (4x speed)",
                            wl.mooncake_trace(trace, bs, time_scale=0.25, limit=n), 4096))
    else:
        print(f"(e) skipped: trace not found at {trace}")
    return out


def hint_runs(args: argparse.Namespace) -> dict:
    """(h) many short-prefix chat sessions (a first turn shorter than a block, no system prompt):
    prefix_cost with the clients' session keys (x-session-id / prompt_cache_key) and without,
    under exact events at one gateway, and with the approximate index (replicas publishing no
    events) at two gateways that share no state - where each gateway has seen only the turns it
    routed itself."""
    requests = wl.multi_turn(random.Random(args.seed + 7), args.requests, args.rate, args.block_size,
                             turns=8, first_tokens=10, turn_tokens=24)
    bare = [replace(r, session=None) for r in requests]
    print(f"\n(h) routing hints: {len(requests)} requests of short-prefix chat sessions, "
          "prefix_cost with and without the session key")
    print(f"{'index':<22}{'gw':>3}{'hints':>7}{'hit':>8}{'ttft p50':>10}{'ttft p99':>10}")
    out = {}
    for label, feed, gateways in (("exact (events)", "native", 1), ("approximate", "none", 2)):
        for hinted, reqs in (("yes", requests), ("no", bare)):
            r = simulate(reqs, "prefix_cost", args.replicas, 1024, args.block_size,
                         gateways=gateways, shared=False, seed=args.seed, feed=feed)
            out[(feed, hinted)] = r
            print(f"{label:<22}{gateways:>3}{hinted:>7}{r.hit_rate:>8.3f}"
                  f"{r.ttft_p50 * 1000:>8.0f}ms{r.ttft_p99 * 1000:>8.0f}ms")
    summary = {}
    for feed, tag in (("native", "exact"), ("none", "approx_2gw")):
        yes, no = out[(feed, "yes")], out[(feed, "no")]
        summary[f"hints_hit_{tag}"] = round(yes.hit_rate, 3)
        summary[f"no_hints_hit_{tag}"] = round(no.hit_rate, 3)
        summary[f"hints_ttft_p50_ratio_{tag}"] = round(yes.ttft_p50 / no.ttft_p50, 3)
        summary[f"hints_ttft_p99_ratio_{tag}"] = round(yes.ttft_p99 / no.ttft_p99, 3)
    return summary


def foreign_workloads(args: argparse.Namespace) -> list[Workload]:
    """Caches that evict under pressure: (a) as above, (p) the same on half the KV cache, (b)
    multi-turn chats."""
    bs, n = args.block_size, args.requests
    return [
        Workload("a", "multi-tenant system prompts",
                 wl.multi_tenant(random.Random(args.seed), n, args.rate, bs), 1024),
        Workload("p", "multi-tenant, half the KV cache",
                 wl.multi_tenant(random.Random(args.seed), n, args.rate, bs), 512),
        Workload("b", "multi-turn chats",
                 wl.multi_turn(random.Random(args.seed + 1), n, args.rate * 0.75, bs), 1024),
    ]


def run_workload(w: Workload, policies: list[str], replicas: int, seed: int) -> tuple[float, list[SimResult]]:
    upper = pooled_upper_bound(w.requests, replicas * w.capacity_blocks, 16)
    results = []
    for policy in policies:
        configs = GATEWAY_CONFIGS if (w.all_gateway_configs or policy == "prefix_cost") else [(1, True)]
        for gateways, shared in configs:
            results.append(simulate(w.requests, policy, replicas, w.capacity_blocks,
                                    gateways=gateways, shared=shared, seed=seed))
    return upper, results


def print_table(w: Workload, upper: float, results: list[SimResult]) -> None:
    print(f"\n({w.key}) {w.title}: {len(w.requests)} requests, pooled upper bound hit "
          f"{upper:.3f}, {w.capacity_blocks} blocks per replica")
    print(f"{'policy':<17}{'gw':>3}{'state':>9}{'hit':>8}{'hit/up':>8}{'max/mean':>9}"
          f"{'ttft p50':>10}{'ttft p99':>10}{'|pred-act|':>11}")
    for r in results:
        state = "shared" if r.shared or r.gateways == 1 else "local"
        print(f"{r.policy:<17}{r.gateways:>3}{state:>9}{r.hit_rate:>8.3f}{r.hit_rate / upper if upper else float('nan'):>8.3f}"
              f"{r.load_max_over_mean:>9.2f}{r.ttft_p50 * 1000:>8.0f}ms{r.ttft_p99 * 1000:>8.0f}ms"
              f"{r.predicted_error_tokens:>11.1f}")


def one(results: list[SimResult], policy: str, gateways: int = 1, shared: bool = True) -> SimResult:
    return next(r for r in results if r.policy == policy and r.gateways == gateways
                and (r.shared == shared or gateways == 1))


def plot(all_results: dict[str, tuple[float, list[SimResult]]], policies: list[str]) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    RESULTS.mkdir(parents=True, exist_ok=True)
    keys = list(all_results)
    width = 0.8 / len(policies)
    paths = []
    for metric, label, fname in [("hit_rate", "prefix-cache hit rate", "routing_sim_hit_rate.png"),
                                 ("ttft_p50", "modelled TTFT p50 (s)", "routing_sim_ttft_p50.png"),
                                 ("ttft_p99", "modelled TTFT p99 (s)", "routing_sim_ttft_p99.png")]:
        fig, ax = plt.subplots(figsize=(10, 4.5))
        for i, policy in enumerate(policies):
            values = [getattr(one(all_results[k][1], policy), metric) for k in keys]
            ax.bar([x + i * width for x in range(len(keys))], values, width, label=policy)
        if metric == "hit_rate":
            ax.scatter([x + 0.4 - width / 2 for x in range(len(keys))],
                       [all_results[k][0] for k in keys], marker="_", s=900, color="black",
                       label="pooled upper bound", zorder=3)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(keys))], [f"({k})" for k in keys])
        ax.set_ylabel(label)
        ax.set_title(f"routing simulator, K=4 replicas, 1 gateway: {label}")
        ax.legend(fontsize=8, ncol=4)
        fig.tight_layout()
        fig.savefig(RESULTS / fname, dpi=110)
        plt.close(fig)
        paths.append(RESULTS / fname)
    return paths


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=None, help="Mooncake JSONL trace (16-token blocks)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=8.0, help="arrivals per second, (a)-(d)")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--foreign", action="store_true",
                        help="replicas publishing vLLM-format KV events: zmq vs native vs approximate")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    if args.foreign:
        summary = run_foreign(foreign_workloads(args), args.replicas, args.seed, args.block_size)
        print(f"\nelapsed {time.perf_counter() - started:.1f}s")
        print(json.dumps(summary))
        results_file.write("routing_sim", summary, {"args": vars(args)}, argv=argv,
                           name="routing_sim_foreign")
        return summary
    policies = list(REGISTRY)
    all_results = {}
    for w in build_workloads(args):
        upper, results = run_workload(w, policies, args.replicas, args.seed)
        print_table(w, upper, results)
        all_results[w.key] = (upper, results)
    if not args.no_plots:
        paths = plot(all_results, policies)
        print("\nplots: " + ", ".join(str(p.relative_to(REPO)) for p in paths))
    upper_a, res_a = all_results["a"]
    kv, rr = one(res_a, "prefix_cost"), one(res_a, "round_robin")
    kv_d, ll_d = one(all_results["d"][1], "prefix_cost"), one(all_results["d"][1], "least_load")
    summary = {
        "hit_vs_upper": round(kv.hit_rate / upper_a, 3),
        "hit_vs_round_robin": round(kv.hit_rate / max(1e-9, rr.hit_rate), 3),
        "load_max_over_mean": round(kv.load_max_over_mean, 3),
        "ttft_p50_vs_round_robin": round(kv.ttft_p50 / rr.ttft_p50, 3),
        "hit_4gw_over_1gw": round(one(res_a, "prefix_cost", 4, True).hit_rate / kv.hit_rate, 3),
        "noreuse_ttft_vs_least_load": round(kv_d.ttft_p50 / ll_d.ttft_p50, 3),
        **hint_runs(args),
    }
    print(f"\nelapsed {time.perf_counter() - started:.1f}s")
    print(json.dumps(summary))
    workloads = {key: {"pooled_upper_bound": upper, "runs": [asdict(r) for r in results]}
                 for key, (upper, results) in all_results.items()}
    results_file.write("routing_sim", summary, {"args": vars(args), "workloads": workloads}, argv=argv)
    return summary


if __name__ == "__main__":
    main()
