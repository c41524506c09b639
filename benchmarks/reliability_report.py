"""Reliability and security report: the fault scenarios (mid-stream migration among them: 50
concurrent streams with a replica killed, hung or drained; stall detection: a silent but alive
stream kept, a hung replica's stream moved), bad input, schema fuzzing, the security
checks and a soak at moderate load, on local clusters of tiny-model replicas (2 replicas,
2 gateways and Redis for the faults and the soak). Prints a table, then one line of JSON:
{"requests_lost", "scenarios_passed", "scenarios_total", "fuzz_5xx", "rss_growth_mb"}.

    python -m benchmarks.reliability_report            # 5-minute soak, 100 fuzz examples per operation
    python -m benchmarks.reliability_report --quick    # 1-minute soak, 25 examples
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

from benchmarks import results_file
from benchmarks.reliability import pool_exhaustion
from benchmarks.reliability.bad_input import bad_input
from benchmarks.reliability.cluster import MAX_BODY_BYTES, ClusterSpec, LocalCluster
from benchmarks.reliability.fuzz import fuzz
from benchmarks.reliability.migration import migration_limit, streams_migrate
from benchmarks.reliability.replica_faults import replica_hung, replica_killed, replica_slow
from benchmarks.reliability.result import ScenarioResult
from benchmarks.reliability.security import security, secured_spec
from benchmarks.reliability.soak import soak
from benchmarks.reliability.stall import hung_stream_moves, silent_stream_kept, stall_cluster
from benchmarks.reliability.state_faults import client_disconnects, gateway_killed, redis_restarted


def _rss_by_pid(cluster: LocalCluster) -> dict[int, tuple[str, float]]:
    sizes = cluster.rss_mb()
    return {c.pid: (c.spec.name, sizes[c.spec.name]) for c in (*cluster.replicas, *cluster.gateways)
            if c.pid is not None and c.spec.name in sizes}


def _run(cluster: LocalCluster, scenario: Callable[[], ScenarioResult], say) -> ScenarioResult:  # noqa: ANN001
    before = _rss_by_pid(cluster)
    t0 = time.monotonic()
    try:
        result = scenario()
    except Exception as exc:  # noqa: BLE001 - a scenario that breaks is a failed scenario
        result = ScenarioResult(getattr(scenario, "__name__", "scenario"), checks={"ran": False},
                                notes={"exception": repr(exc)})
    after = _rss_by_pid(cluster)
    if not result.rss_growth_mb:  # processes restarted by the scenario have no growth to show
        result.rss_growth_mb = {name: round(after[pid][1] - rss, 1) for pid, (name, rss) in before.items()
                                if pid in after}
    result.notes["seconds"] = round(time.monotonic() - t0, 1)
    say(f"  {'PASS' if result.passed else 'FAIL'} {result.name} ({result.notes['seconds']} s)"
        + ("" if result.passed else f": {_why(result)} {result.notes}"))
    return result


def run_all(soak_s: float, fuzz_examples: int, say=print) -> list[ScenarioResult]:  # noqa: ANN001
    results: list[ScenarioResult] = []
    say("cluster: 2 replicas, 2 gateways, Redis")
    with LocalCluster(ClusterSpec()) as cluster:
        for scenario in (lambda: soak(cluster, soak_s), lambda: replica_killed(cluster),
                         lambda: replica_hung(cluster), lambda: replica_slow(cluster),
                         lambda: streams_migrate(cluster, "kill"), lambda: streams_migrate(cluster, "hang"),
                         lambda: streams_migrate(cluster, "drain"), lambda: migration_limit(cluster),
                         lambda: redis_restarted(cluster),
                         lambda: gateway_killed(cluster), lambda: client_disconnects(cluster),
                         lambda: bad_input(cluster.gateways[0].spec.url, cluster.replicas[0].spec.url,
                                           MAX_BODY_BYTES),
                         lambda: fuzz(cluster.gateways[0].spec.url, cluster.replicas[0].spec.url, fuzz_examples)):
            results.append(_run(cluster, scenario, say))
    say("cluster: 1 slowed replica and 1 plain one (6-block KV pools), 1 gateway with slow health checks")
    with stall_cluster() as cluster:
        for scenario in (lambda: silent_stream_kept(cluster), lambda: hung_stream_moves(cluster)):
            results.append(_run(cluster, scenario, say))
    say("cluster: 1 replica with a 24-block KV pool, 1 gateway")
    with LocalCluster(pool_exhaustion.pool_spec()) as cluster:
        results.append(_run(cluster, lambda: pool_exhaustion.pool_exhausted(cluster, prompts=12, rounds=2), say))
    say("cluster: 1 replica, 1 gateway with three keys, two of them isolated")
    with LocalCluster(secured_spec()) as cluster:
        results.append(_run(cluster, lambda: security(cluster), say))
    return results


def _growth(result: ScenarioResult, role: str) -> str:
    values = [v for name, v in result.rss_growth_mb.items() if name.startswith(role)]
    return f"{max(values):+.1f}" if values else "-"


def _why(result: ScenarioResult) -> list[str]:
    return result.failed_checks() + (["requests lost"] if result.lost else [])


def table(results: list[ScenarioResult]) -> str:
    head = ("| scenario | sent | succeeded | failed | lost | gateway RSS growth (MB) | replica RSS growth (MB) "
            "| passed |\n|---|---|---|---|---|---|---|---|")
    rows = [f"| {r.name} | {r.sent} | {r.succeeded} | {r.failed} | {r.lost} | {_growth(r, 'gateway')} "
            f"| {_growth(r, 'replica')} | {'yes' if r.passed else 'NO: ' + ', '.join(_why(r))} |"
            for r in results]
    return "\n".join([head, *rows])


def summary(results: list[ScenarioResult]) -> dict:
    soak_result = next((r for r in results if r.name.startswith("soak")), None)
    fuzz_result = next((r for r in results if r.name.startswith("schema fuzzing")), None)
    return {"requests_lost": sum(r.lost for r in results),
            "scenarios_passed": sum(r.passed for r in results),
            "scenarios_total": len(results),
            "fuzz_5xx": fuzz_result.failed if fuzz_result is not None else None,
            "rss_growth_mb": max(soak_result.rss_growth_mb.values()) if soak_result and soak_result.rss_growth_mb else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a 1-minute soak and 25 fuzz examples per operation")
    p.add_argument("--soak-s", type=float, default=None, help="soak duration (default 300, --quick 60)")
    p.add_argument("--fuzz-examples", type=int, default=None, help="per operation and mode (default 100, --quick 25)")
    p.add_argument("--details", default=None, metavar="FILE", help="also write every scenario's checks and notes as JSON")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    soak_s = args.soak_s or (60.0 if args.quick else 300.0)
    examples = args.fuzz_examples or (25 if args.quick else 100)
    results = run_all(soak_s, examples, say=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(results))
    if args.details:
        with open(args.details, "w") as f:
            json.dump([{"name": r.name, "checks": r.checks, "notes": r.notes, "rss_growth_mb": r.rss_growth_mb}
                       for r in results], f, indent=1, default=str)
    figures = summary(results)
    print(json.dumps(figures))
    scenarios = [{"name": r.name, "passed": r.passed, "sent": r.sent, "succeeded": r.succeeded,
                  "failed": r.failed, "lost": r.lost, "failed_checks": r.failed_checks()} for r in results]
    results_file.write("reliability_report", figures,
                       {"args": vars(args), "soak_s": soak_s, "fuzz_examples": examples, "scenarios": scenarios},
                       argv=argv, name="reliability_report_quick" if args.quick else None)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
