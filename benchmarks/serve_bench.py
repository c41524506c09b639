"""The live end-to-end benchmark: an async OpenAI-compatible load client against real gateways
and engine replicas on this machine (loopback only).

Against a running endpoint (a gateway or a replica):

    python -m benchmarks.serve_bench --base-url http://127.0.0.1:8000/v1 --api-key K \\
        --workload multi_tenant --num-requests 200 --concurrency 8 [--rate 4] [--duration 120]
    workloads: multi_tenant, multi_turn, best_of_n, no_reuse, trace (--trace FILE, Mooncake JSONL)

Policies compared on a private cluster (4 replicas of the default model with small KV pools,
1 gateway, then 2 gateways sharing Redis), report and plots under benchmarks/results/:

    python -m benchmarks.serve_bench --compare-policies [--quick]

The last line is JSON: {"ttft_p50_vs_round_robin", "throughput_vs_round_robin", "cached_ratio",
"cached_ratio_2gw_over_1gw"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import results_file
from benchmarks.serve_bench_client import LoadClient, LoadSpec, RequestResult, discover_model
from benchmarks.serve_bench_stats import (Summary, format_summary, gateway_replicas, replica_counters,
                                          summarize)
from benchmarks.serve_bench_workloads import WORKLOADS, WorkloadParams, build, ideal_cached_ratio

RESULTS = Path(__file__).with_name("results")
BLOCK = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--base-url", action="append", default=None,
                   help="OpenAI base URL (…/v1); repeat for several gateways, used in turn")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="default: the first id of /v1/models")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="multi_tenant")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight, at most")
    p.add_argument("--rate", type=float, default=None,
                   help="open loop: jobs per second (Poisson; trace: its own timestamps). Default: closed loop")
    p.add_argument("--duration", type=float, default=None, help="no request starts after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-tokens", type=int, default=None, help="shared prefix / first-turn length")
    p.add_argument("--suffix-tokens", type=int, default=None)
    p.add_argument("--output-tokens", type=int, default=None)
    p.add_argument("--tenants", type=int, default=None)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--siblings", type=int, default=4)
    p.add_argument("--trace", default=None, help="Mooncake JSONL file (e.g. ../shared/data/traces/*_bs16.jsonl)")
    p.add_argument("--trace-time-scale", type=float, default=0.05)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--replica-metrics", action="append", default=[],
                   help="replica base URL whose /metrics gives per-replica hit rates; repeatable")
    p.add_argument("--admin-key", default=None, help="gateway admin key: per-replica counts from /admin/api")
    p.add_argument("--json-out", default=None, help="write the summary (and per-request records) here")
    p.add_argument("--compare-policies", action="store_true", help="start a private cluster and compare policies")
    p.add_argument("--quick", action="store_true", help="with --compare-policies: the under-5-minute variant")
    p.add_argument("--policies", default="prefix_cost,round_robin,least_load")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--cluster-model", default="default")
    return p.parse_args(argv)


def workload_params(args: argparse.Namespace, defaults: WorkloadParams) -> WorkloadParams:
    p = defaults
    for name in ("num_requests", "prompt_tokens", "suffix_tokens", "output_tokens", "tenants"):
        if getattr(args, name) is not None:
            setattr(p, name, getattr(args, name))
    p.seed, p.turns, p.siblings = args.seed, args.turns, args.siblings
    p.trace, p.trace_time_scale, p.max_prompt_tokens = args.trace, args.trace_time_scale, args.max_prompt_tokens
    if args.rate is not None:
        p.rate = args.rate
    return p


async def run_load(base_urls: list[str], api_key: str | None, model: str | None, jobs, concurrency: int,
                   rate: float | None, duration: float, label: str, replica_urls: list[str],
                   admin_key: str | None = None) -> tuple[Summary, list[RequestResult]]:
    model = model or await discover_model(base_urls[0], api_key)
    before = await replica_counters(replica_urls) if replica_urls else []
    client = LoadClient(LoadSpec(base_urls, model, api_key, concurrency, rate, duration))
    results = await client.run(jobs)
    replicas = []
    if replica_urls:
        # The engine publishes counters after the step; a short pause lets the last ones land.
        await asyncio.sleep(0.3)
        from benchmarks.serve_bench_stats import delta

        replicas = delta(await replica_counters(replica_urls), before)
    elif admin_key:
        replicas = await gateway_replicas([u.removesuffix("/v1") for u in base_urls], admin_key)
    return summarize(label, results, client.elapsed, replicas), results


# ---- against an existing endpoint ----------------------------------------------------------

def run_endpoint(args: argparse.Namespace) -> int:
    params = workload_params(args, WorkloadParams())
    jobs = build(args.workload, params)
    duration = args.duration or 300.0
    summary, results = asyncio.run(run_load(
        args.base_url, args.api_key, args.model, jobs, args.concurrency,
        # Open loop at --rate, or at the trace's own (scaled) timestamps; else closed loop.
        args.rate if args.rate is not None else (1.0 if args.workload == "trace" else None),
        duration, args.workload,
        args.replica_metrics, args.admin_key))
    print(format_summary(summary))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"summary": summary.to_dict(), "requests": [
            {"group": r.group, "start": r.start, "ok": r.ok, "ttft": r.ttft, "e2e": r.e2e, "tpot": r.tpot,
             "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
             "completion_tokens": r.completion_tokens, "error": r.error} for r in results]}))
    line = {"workload": args.workload, "req_per_s": round(summary.req_per_s, 3),
            "ttft_p50_ms": _ms(summary.ttft["p50"]), "ttft_p99_ms": _ms(summary.ttft["p99"]),
            "tpot_p50_ms": _ms(summary.tpot["p50"]), "cached_ratio": round(summary.cached_ratio, 3),
            "errors": summary.errors}
    print(json.dumps(line))
    results_file.write("serve_bench", line, {"args": vars(args), "run": summary.to_dict()},
                       name="serve_bench_endpoint")
    return 0 if summary.ok else 1


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


# ---- --compare-policies --------------------------------------------------------------------

@dataclass(slots=True)
class CompareSetup:
    workload: WorkloadParams
    concurrency: int
    duration_s: float
    num_kv_blocks: int
    replicas: int


def compare_setup(args: argparse.Namespace) -> CompareSetup:
    if args.quick:
        wp = WorkloadParams(num_requests=72, tenants=12, prompt_tokens=256, suffix_tokens=24, output_tokens=6)
        duration = 40.0
    else:
        wp = WorkloadParams(num_requests=200, tenants=16, prompt_tokens=384, suffix_tokens=32, output_tokens=8)
        duration = 110.0
    wp = workload_params(args, wp)
    # The tenants' system prompts are the working set. Each replica's pool holds about half of
    # it (plus room for the requests in flight), so one replica cannot hold every tenant while
    # the four together hold all of them twice over.
    working_set = wp.tenants * (wp.prompt_tokens // BLOCK)
    in_flight = args.concurrency * math.ceil((wp.suffix_tokens * 3 // 2 + wp.output_tokens) / BLOCK + 1)
    blocks = working_set // 2 + in_flight
    return CompareSetup(wp, args.concurrency, args.duration or duration, blocks, args.replicas)


def compare_policies(args: argparse.Namespace) -> int:
    from benchmarks.serve_bench_cluster import Cluster, ClusterSpec
    from benchmarks.serve_bench_report import markdown, plots

    t_start = time.monotonic()
    setup = compare_setup(args)
    wp = setup.workload
    jobs = build("multi_tenant", wp)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    runs = [(p, 1) for p in policies] + [("prefix_cost", 2)]
    working_set = wp.tenants * (wp.prompt_tokens // BLOCK)
    bound = ideal_cached_ratio(jobs, BLOCK)
    print(f"serve_bench: {setup.replicas} replicas of {args.cluster_model}, {setup.num_kv_blocks} KV blocks each "
          f"(working set {working_set} blocks of system prompts), 1 thread each; multi_tenant: "
          f"{wp.tenants} tenants × {wp.prompt_tokens}-token system prompts, {wp.num_requests} requests, "
          f"concurrency {setup.concurrency}, ≤{setup.duration_s:.0f}s per run; fresh replicas per run; "
          f"cached-ratio bound (one unbounded cache, cold start) {bound:.3f}", flush=True)
    summaries: list[Summary] = []
    results: dict[str, list[RequestResult]] = {}
    for policy, gateways in runs:
        label = f"{policy} ({gateways} gw{' + redis' if gateways > 1 else ''})"
        spec = ClusterSpec(replicas=setup.replicas, gateways=gateways, policy=policy, model=args.cluster_model,
                           num_kv_blocks=setup.num_kv_blocks)
        t0 = time.monotonic()
        # Fresh replicas for every run (start-up is a few seconds): each policy starts with
        # empty caches and zeroed counters, which a cache flush over HTTP could not guarantee.
        with Cluster(spec) as cluster:
            up_s = time.monotonic() - t0
            summary, res = asyncio.run(run_load(
                cluster.base_urls, cluster.api_key, None, jobs, setup.concurrency, None, setup.duration_s,
                label, cluster.replica_urls))
        summaries.append(summary)
        results[label] = res
        print(f"(cluster up in {up_s:.0f}s)\n" + format_summary(summary), flush=True)

    by = {s.label: s for s in summaries}
    kv1 = by.get("prefix_cost (1 gw)")
    rr = by.get("round_robin (1 gw)")
    kv2 = by.get("prefix_cost (2 gw + redis)")

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    headline = {
        "ttft_p50_vs_round_robin": ratio(kv1 and kv1.ttft["p50"], rr and rr.ttft["p50"]),
        "throughput_vs_round_robin": ratio(kv1 and kv1.req_per_s, rr and rr.req_per_s),
        "cached_ratio": None if kv1 is None else round(kv1.cached_ratio, 3),
        "cached_ratio_2gw_over_1gw": ratio(kv2 and kv2.cached_ratio, kv1 and kv1.cached_ratio),
    }
    RESULTS.mkdir(exist_ok=True)
    prefix = "serve_bench_quick" if args.quick else "serve_bench"
    plot_paths = plots(RESULTS, prefix, summaries, results)
    command = "python -m benchmarks.serve_bench --compare-policies" + (" --quick" if args.quick else "")
    setup_text = (f"{setup.replicas} CPU replicas of `{args.cluster_model}` (1 torch thread each, "
                  f"`--num-kv-blocks {setup.num_kv_blocks}`), started fresh for every run through "
                  f"`kvgate.launcher`; workload multi_tenant: {wp.tenants} tenants, {wp.prompt_tokens}-token "
                  f"system prompts (working set {working_set} blocks), {wp.suffix_tokens // 2}–"
                  f"{wp.suffix_tokens * 3 // 2}-token questions, {wp.output_tokens} forced output tokens, "
                  f"Zipf {wp.zipf_s} tenant skew, {wp.num_requests} requests closed-loop at concurrency "
                  f"{setup.concurrency}, at most {setup.duration_s:.0f} s per run. Hit rate per replica "
                  f"from each replica's /metrics. Cached-ratio bound (one unbounded cache shared by all replicas, "
                  f"cold start, all requests sent): {bound:.3f}. Wall time {time.monotonic() - t_start:.0f} s.")
    md = markdown(command, setup_text, summaries, headline, plot_paths)
    (RESULTS / f"{prefix}.md").write_text(md)
    results_file.write("serve_bench", headline, {
        "args": vars(args), "replicas": setup.replicas, "num_kv_blocks": setup.num_kv_blocks,
        "workload": asdict(wp), "concurrency": setup.concurrency, "duration_s": setup.duration_s,
        "cached_ratio_bound": round(bound, 3), "runs": [s.to_dict() for s in summaries]}, name=prefix)
    print(f"report: {RESULTS / (prefix + '.md')}; plots: {', '.join(str(p) for p in plot_paths)}")
    print(json.dumps(headline))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare_policies:
        return compare_policies(args)
    if not args.base_url:
        print("serve_bench: give --base-url (or --compare-policies)", file=sys.stderr)
        return 2
    return run_endpoint(args)


if __name__ == "__main__":
    sys.exit(main())
