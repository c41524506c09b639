"""kvgate's routing in two tiers, measured in one run and in turns: (a) kvgate's own gateway, a
Python proxy, and (b) Envoy with `kvgate picker` as its ext_proc endpoint picker.

    python -m benchmarks.envoy_picker [--rate 20] [--p99-bound-ms 250] [--replicas 2] [--quick]

Part 1, the routing tier alone: two benchmark FIXTURE upstreams (benchmarks.gateway_overhead's
HTTP server that answers a streamed chat completion at once; no model) behind each tier, so
what differs is only the tier. The fixtures answer with a kvgate replica's usage headers, so
the picker reads usage from the response headers and asks Envoy for none of the body; a third
run, `envoy_foreign`, puts Envoy and the picker before fixtures without them (as a vLLM replica
answers), where the picker reads usage from the streamed body, one message per chunk.
Streamed chat requests, open loop: at `--rate` the latency added over the fixture reached
directly (p50, p99; direct and through the tier in `--rounds` turns) and the CPU seconds per
request of the tier's processes (the gateway; Envoy + picker) from /proc; then a stepped rate
search (x`--step` per step, `--step-s` seconds each, a failed step measured once more,
`--search-budget-s` per tier) for the highest rate at which every request succeeds, completions
keep up with arrivals, and p99 stays under the bound, refined by `--refine` bisections between
the last rate sustained and the first that failed.

Part 2, routing quality: `--replicas` real replicas of the default model (2 by default, for a
shared 2-core machine; eager unless `--compiled`), started fresh for every run, serve_bench's
multi_tenant workload (the `--compare-policies --quick` sizing: 72 requests) through each tier in
`--quality-rounds` rounds (3; the order alternates): cached-token ratio and TTFT p50 over each
tier's pooled requests, and each round's. One run of 72 requests moves by more than 0.02 in
cached-token ratio between identical runs; the rounds say how much.

The last line is JSON: {"max_rate_vs_gateway", "cached_ratio_envoy", "cached_ratio_gateway",
"added_p99_ms_envoy", "added_p99_ms_gateway", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

from benchmarks import results_file, serve_bench
from benchmarks.gateway_overhead import FIXTURE_MODEL, _ok, _pct, _tokenizer_folder, _wait, open_loop
from benchmarks.routing_tier import EnvoyTier, GatewayTier, Tier, free_port

TIERS = {"gateway": GatewayTier, "envoy": EnvoyTier}
# Part 1 also runs Envoy + picker before replicas that are not kvgate's (no usage headers)
TIER_VARIANTS = {**TIERS, "envoy_foreign": EnvoyTier}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--rate", type=float, default=20.0, help="requests/s of the fixed-rate run")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of the fixed-rate run, per path")
    p.add_argument("--rounds", type=int, default=3, help="turns of direct then tier in the fixed-rate run")
    p.add_argument("--p99-bound-ms", type=float, default=250.0, help="the rate search's latency bound")
    p.add_argument("--search-start", type=float, default=5.0, help="first rate of the search")
    p.add_argument("--step", type=float, default=1.4, help="rate factor between search steps")
    p.add_argument("--step-s", type=float, default=5.0, help="seconds per search step")
    p.add_argument("--refine", type=int, default=2, help="bisections after the stepped search")
    p.add_argument("--search-budget-s", type=float, default=150.0, help="search time per tier, at most")
    p.add_argument("--envoy-concurrency", type=int, default=1, help="Envoy worker threads")
    p.add_argument("--replicas", type=int, default=2, help="real replicas for part 2")
    p.add_argument("--concurrency", type=int, default=8, help="part 2's requests in flight")
    p.add_argument("--quality-duration", type=float, default=150.0,
                   help="part 2: no request starts after this many seconds per tier")
    p.add_argument("--quality-rounds", type=int, default=3,
                   help="part 2: runs per tier, in alternating order, each on fresh replicas")
    p.add_argument("--compiled", action="store_true",
                   help="part 2's replicas compile their graphs (default: eager, a quick start on a busy machine)")
    p.add_argument("--skip-quality", action="store_true", help="part 1 only")
    p.add_argument("--quick", action="store_true", help="short runs (a smoke test of the script)")
    a = p.parse_args(argv)
    if a.quick:
        a.duration, a.step_s, a.search_budget_s, a.quality_duration = 5.0, 2.0, 20.0, 40.0
        a.quality_rounds = 1
    return a


# ---- part 1: the routing tier ---------------------------------------------------------------

def _latencies(base: str, rate: float, duration: float) -> tuple[list[float], int, float]:
    """(successful latencies, failures, seconds from the first start to the last completion)."""
    t0 = time.perf_counter()
    every = asyncio.run(open_loop(base, rate, duration, stream=True))
    return _ok(every), len(every) - len(_ok(every)), time.perf_counter() - t0


def sustains(base: str, rate: float, step_s: float, bound_s: float) -> tuple[bool, float]:
    ok, failed, took = _latencies(base, rate, step_s)
    p99 = _pct(ok, 0.99) if ok else float("inf")
    # Completions keep up: the run ends within the bound of its last arrival (plus the warm-up).
    return failed == 0 and p99 <= bound_s and took <= step_s + 1.0 + bound_s, p99


def rate_search(base: str, args: argparse.Namespace, say) -> dict:
    """Step the rate up until a step fails twice in a row (a failed step is measured once more:
    a busy shared machine stalls a single run now and then), or the time budget is spent; then
    `--refine` bisections (geometric) between the highest rate sustained and the lowest failed,
    so that two tiers a step apart are not read as a whole step (x`--step`) apart."""
    rate, best, steps, deadline = args.search_start, 0.0, [], time.monotonic() + args.search_budget_s
    failed_at = None

    def sustained(rate: float) -> bool:
        for _ in range(2):  # a failure is measured once more
            if time.monotonic() + args.step_s > deadline:
                return False
            good, p99 = sustains(base, rate, args.step_s, args.p99_bound_ms / 1000)
            steps.append({"rate": round(rate, 1), "p99_ms": round(1000 * p99, 2), "sustained": good})
            say(f"  {rate:7.1f} req/s: p99 {1000 * p99:8.1f} ms {'ok' if good else 'over'}")
            if good:
                return True
        return False

    while time.monotonic() + args.step_s <= deadline:
        if not sustained(rate):
            failed_at = rate
            break
        best, rate = rate, rate * args.step
    for _ in range(args.refine if best and failed_at else 0):
        middle = (best * failed_at) ** 0.5
        if time.monotonic() + args.step_s > deadline:
            break
        if sustained(middle):
            best = middle
        else:
            failed_at = middle
    return {"max_rate": round(best, 1), "steps": steps}


def routing_tier(args: argparse.Namespace, say) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    fixtures: dict[bool, tuple[list[str], list[subprocess.Popen]]] = {}
    for headers in (True, False):  # kvgate replicas' usage headers, or none
        ports = [free_port(), free_port()]
        fixtures[headers] = ([f"http://127.0.0.1:{p}" for p in ports], [subprocess.Popen(
            [sys.executable, "-m", "benchmarks.gateway_overhead", "--serve-fixture", "--port", str(p),
             *(["--usage-headers"] if headers else [])], env=env) for p in ports])
    out: dict = {}
    try:
        for urls, procs in fixtures.values():
            for url, proc in zip(urls, procs):
                _wait(url + "/health", proc)
        for name, tier_class in TIER_VARIANTS.items():
            kw = {} if name == "gateway" else {"envoy_concurrency": args.envoy_concurrency}
            urls = fixtures[name != "envoy_foreign"][0]
            with tier_class(urls, f"{FIXTURE_MODEL}={_tokenizer_folder()}", **kw) as tier:
                out[name] = _measure_tier(name, tier, urls[0], args, say)
    finally:
        for _, procs in fixtures.values():
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=10)
    return out


def _measure_tier(name: str, tier: Tier, direct_url: str, args: argparse.Namespace, say) -> dict:
    """At the fixed rate, in `--rounds` turns: the fixture directly, then through the tier (a
    busy machine's load drifts; each tier's baseline is measured beside it)."""
    direct, ok, failed, cpu = [], [], 0, dict.fromkeys(tier.procs, 0.0)
    for _ in range(args.rounds):
        direct += _latencies(direct_url, args.rate, args.duration / args.rounds)[0]
        cpu0 = tier.cpu_seconds()
        through, lost, _ = _latencies(tier.url, args.rate, args.duration / args.rounds)
        ok, failed = ok + through, failed + lost
        for process, seconds in tier.cpu_seconds().items():
            cpu[process] += seconds - cpu0[process]
    d50, d99 = 1000 * _pct(direct, 0.5), 1000 * _pct(direct, 0.99)
    p50, p99, n = 1000 * _pct(ok, 0.5), 1000 * _pct(ok, 0.99), len(ok) + failed
    row = {"direct_p50_ms": round(d50, 2), "direct_p99_ms": round(d99, 2),
           "p50_ms": round(p50, 2), "p99_ms": round(p99, 2), "failed": failed,
           "added_p50_ms": round(p50 - d50, 2), "added_p99_ms": round(p99 - d99, 2),
           "cpu_ms_per_request": round(1000 * sum(cpu.values()) / n, 3),
           "cpu_ms_per_request_by_process": {k: round(1000 * v / n, 3) for k, v in cpu.items()}}
    say(f"{name}: at {args.rate:g} req/s added p50 {row['added_p50_ms']} ms, p99 {row['added_p99_ms']} ms, "
        f"{row['cpu_ms_per_request']} CPU ms/request, {failed} failed; rate search:")
    return row | rate_search(tier.url, args, say)


# ---- part 2: routing quality on real replicas -----------------------------------------------

def quality(args: argparse.Namespace, say) -> dict:
    """`--quality-rounds` rounds, the tiers' order alternating; every run on fresh replicas.
    Each tier's figures pool its rounds' requests; each round's own figures beside them."""
    from benchmarks.serve_bench_stats import summarize

    setup = serve_bench.compare_setup(serve_bench.parse_args(
        ["--compare-policies", "--quick", "--replicas", str(args.replicas),
         "--concurrency", str(args.concurrency), "--duration", str(args.quality_duration)]))
    runs: dict[str, list] = {name: [] for name in TIERS}
    for round_ in range(args.quality_rounds):
        for name in (list(TIERS) if round_ % 2 == 0 else list(reversed(TIERS))):
            runs[name].append(_quality_run(name, setup, args, say))
    out = {}
    for name, tier_runs in runs.items():
        pooled = summarize(name, [r for _, results, _ in tier_runs for r in results],
                           sum(summary.elapsed_s for summary, _, _ in tier_runs))
        out[name] = _quality_row(pooled) | {
            "queued": sum(queue["total_queued"] for _, _, queue in tier_runs),
            "queue_timed_out": sum(queue["total_timed_out"] for _, _, queue in tier_runs),
            "rounds": [_quality_row(summary) | {"queued": queue["total_queued"]}
                       for summary, _, queue in tier_runs]}
    out["setup"] = {"replicas": args.replicas, "num_kv_blocks": setup.num_kv_blocks,
                    "concurrency": setup.concurrency, "requests": setup.workload.num_requests,
                    "tenants": setup.workload.tenants, "prompt_tokens": setup.workload.prompt_tokens,
                    "rounds": args.quality_rounds}
    return out


def _quality_run(name: str, setup, args: argparse.Namespace, say) -> tuple:
    """One run of the workload through one tier on fresh replicas (empty caches, zeroed
    counters): (summary, per-request results, the tier's overload queue)."""
    from benchmarks.serve_bench_cluster import Cluster, ClusterSpec
    from benchmarks.serve_bench_stats import format_summary
    from benchmarks.serve_bench_workloads import build
    from kvgate.launcher.tokenizer import tokenizer_folder

    spec = ClusterSpec(replicas=args.replicas, gateways=0, num_kv_blocks=setup.num_kv_blocks,
                       enforce_eager=not args.compiled)
    with Cluster(spec, say=say) as cluster:
        tokenizer = f"*={tokenizer_folder(cluster.config.model, cluster.config.quantization)}"
        with TIERS[name](cluster.replica_urls, tokenizer) as tier:
            summary, results = asyncio.run(serve_bench.run_load(
                [tier.url + "/v1"], None, None, build("multi_tenant", setup.workload),
                setup.concurrency, None, setup.duration_s, name, cluster.replica_urls))
            queue = tier.overload_queue()  # requests that waited for a replica with room
    say(format_summary(summary))
    return summary, results, queue


def _quality_row(summary) -> dict:
    ttft = summary.ttft["p50"]
    return {"cached_ratio": round(summary.cached_ratio, 4), "ok": summary.ok, "errors": summary.errors,
            "ttft_p50_ms": None if ttft is None else round(1000 * ttft, 1),
            "req_per_s": round(summary.req_per_s, 3)}


# ---- the run ---------------------------------------------------------------------------------

def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()

    def say(message: str) -> None:
        print(message, flush=True)

    say(f"envoy_picker: part 1, routing tier over 2 fixture upstreams (streamed chat, open loop); "
        f"{os.cpu_count()} CPUs shared by the load client, the tier and the fixtures")
    tier = routing_tier(args, say)
    quality_rows = {} if args.skip_quality else quality(args, say)
    gw, ev = tier["gateway"], tier["envoy"]
    headline = {
        "max_rate_vs_gateway": _ratio(ev["max_rate"], gw["max_rate"]),
        "max_rate_envoy": ev["max_rate"], "max_rate_gateway": gw["max_rate"],
        "added_p50_ms_envoy": ev["added_p50_ms"], "added_p50_ms_gateway": gw["added_p50_ms"],
        "added_p99_ms_envoy": ev["added_p99_ms"], "added_p99_ms_gateway": gw["added_p99_ms"],
        "cpu_ms_per_request_envoy": ev["cpu_ms_per_request"],
        "cpu_ms_per_request_gateway": gw["cpu_ms_per_request"],
        "max_rate_envoy_foreign": tier["envoy_foreign"]["max_rate"],
        "added_p99_ms_envoy_foreign": tier["envoy_foreign"]["added_p99_ms"],
        "cpu_ms_per_request_envoy_foreign": tier["envoy_foreign"]["cpu_ms_per_request"],
        "cached_ratio_envoy": quality_rows.get("envoy", {}).get("cached_ratio"),
        "cached_ratio_gateway": quality_rows.get("gateway", {}).get("cached_ratio"),
        "ttft_p50_ms_envoy": quality_rows.get("envoy", {}).get("ttft_p50_ms"),
        "ttft_p50_ms_gateway": quality_rows.get("gateway", {}).get("ttft_p50_ms"),
    }
    detail = {"args": vars(args), "cpus": os.cpu_count(), "routing_tier": tier, "quality": quality_rows,
              "wall_s": round(time.monotonic() - t0)}
    say(json.dumps(detail))
    results_file.write("envoy_picker", headline, detail, argv=argv,
                       name="envoy_picker_quick" if args.quick else "envoy_picker")
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
