"""kvgate's gateway against SGLang's model gateway (`smg`, PyPI) on the same kvgate replicas,
set up as a newcomer sets them up: fresh replicas (`kvgate up --gateways 0`), then in turns

  kvgate       `kvgate gateway --replica URL ...` (policy prefix_cost, NO --tokenizer flag:
               it loads the replicas' tokenizer itself)
  round_robin  the same gateway with `--policy round_robin` (the floor)
  smg          `smg launch --worker-urls URL ... --policy cache_aware`

each replaying the same prefix-sharing workloads, one after the other (benchmarks/
vs_smg_workloads.py: whole conversations of the public Mooncake trace by their hash ids, and a
business workload of shared system prompts and documents) as streaming chat, on fresh replicas
for each gateway (the workloads share no prefix with each other).

    python -m benchmarks.vs_smg          # 2 replicas, 40 rows per workload: ~10 min on 2 idle cores
    python -m benchmarks.vs_smg --replicas 4 --rows 120 --compile --window-s 600   # bigger

Per run: finished requests, cached-token ratio (the replicas' own prefix-cache counters), TTFT
p50/p99 and output tokens/s; per workload its cached-token ceiling (benchmarks/cache_ceiling.py:
each prompt's longest shared prefix, by token, with any earlier one: what no routing can beat);
a table, then one JSON line whose `ttft_p50_vs_smg`, `ttft_p99_vs_smg` (kvgate / smg, lower is
better) and `cached_ratio_minus_smg` are the worst over the workloads. A kvgate turn's routing
decisions are kept beside the replicas' logs."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks import results_file
from benchmarks.cache_ceiling import cache_ceilings, chat_prompts
from benchmarks.serve_bench_cluster import Cluster, ClusterSpec, _free_base_port, bench_config
from benchmarks.serve_bench_stats import delta, replica_counters
from benchmarks.trace_load import replay
from benchmarks.trace_load_report import SLO, ServerFigures, figures
from benchmarks.trace_load_workload import single_token_words
from benchmarks.vs_smg_workloads import WORKLOADS, build

GATEWAYS = ("kvgate", "round_robin", "smg")
ADMIN_KEY = "vs-smg-admin"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vs_smg", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: mooncake, business")
    p.add_argument("--gateways", default=",".join(GATEWAYS), help="comma-separated: kvgate, round_robin, smg")
    p.add_argument("--rows", type=int, default=40,
                   help="requests per workload (Mooncake: its first whole conversations)")
    p.add_argument("--max-input-tokens", type=int, default=384,
                   help="Mooncake prompts cut to this many tokens (their shared leading blocks stay)")
    p.add_argument("--replicas", type=int, default=2, help="kvgate replicas of the default model")
    p.add_argument("--num-kv-blocks", type=int, default=384, help="KV pool of each replica, in blocks")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-queue-delay-s", type=float, default=None,
                   help="the replicas' admission bound (kvgate engine --max-queue-delay-s); 0: they "
                        "never refuse for load, so no front sees a 503 engine_overloaded (SMG passes "
                        "it on to the client, kvgate's gateway holds the request)")
    p.add_argument("--compile", action="store_true",
                   help="replicas run their compiled plan (kvgate up's default; minutes to start on "
                        "a loaded 2-core box), instead of eager torch")
    p.add_argument("--output-tokens", type=int, default=8, help="at most, per request")
    p.add_argument("--speedup", type=float, default=6.0,
                   help="Mooncake arrivals this many times faster (40 rows span 642 s of the trace)")
    p.add_argument("--rate", type=float, default=1.0, help="business requests per second (Poisson)")
    p.add_argument("--window-s", type=float, default=150.0,
                   help="per workload run; unfinished requests are cut off")
    p.add_argument("--out", default=str(Path(results_file.RESULTS) / "vs_smg.json"))
    return p.parse_args(argv)


def smg_binary() -> str:
    found = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    if not Path(found).exists():
        raise SystemExit("smg is not installed: pip install smg (or 'kvgate[test]')")
    return found


def front_command(gateway: str, port: int, replicas: list[str]) -> list[str]:
    if gateway == "smg":
        return [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(port + 1),
                "--policy", "cache_aware", "--log-level", "warn", "--worker-urls", *replicas]
    policy = "prefix_cost" if gateway == "kvgate" else gateway
    command = [sys.executable, "-m", "kvgate.cli", "gateway", "--port", str(port), "--policy",
               policy, "--admin-key", ADMIN_KEY, "--log-level", "info"]
    for url in replicas:
        command += ["--replica", url]
    return command


def _serves_model(url: str) -> bool:
    try:
        r = httpx.get(url + "/v1/models", timeout=2)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and bool(r.json().get("data"))


def tokenizer_modes(url: str, gateway: str) -> list[str] | None:
    """How a kvgate gateway tokenises, per replica (its admin API); None for SMG."""
    if gateway == "smg":
        return None
    rows = httpx.get(url + "/admin/api/replicas", timeout=5,
                     headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["data"]
    return sorted({r["tokenizer"] for r in rows})


def routing_decisions(url: str, gateway: str, since: float) -> list[dict] | None:
    """A kvgate gateway's routing decisions since `since` (its admin API), oldest first."""
    if gateway == "smg":
        return None
    rows = httpx.get(url + "/admin/api/decisions", params={"limit": 1000}, timeout=5,
                     headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["data"]
    return [d for d in reversed(rows) if d["ts"] >= since]


async def tokenize_calls(replicas: list[str]) -> int:
    """/tokenize requests the replicas answered (their own HTTP metrics)."""
    total = 0
    async with httpx.AsyncClient(timeout=5) as client:
        for url in replicas:
            for line in (await client.get(url + "/metrics")).text.splitlines():
                if line.startswith("kvgate_http_requests_total{") and 'route="/tokenize"' in line:
                    total += int(float(line.rsplit(" ", 1)[1]))
    return total


def serve(gateway: str, replicas: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """The gateway in front of the replicas, once it lists their model."""
    port = _free_base_port(2)
    with open(log, "ab") as fh:
        front = subprocess.Popen(front_command(gateway, port, replicas), stdout=fh,
                                 stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not _serves_model(url):
        if front.poll() is not None or time.monotonic() > deadline:
            front.kill()
            raise RuntimeError(f"{gateway} did not start; see {log}")
        time.sleep(0.5)
    return front, url


def one_turn(args, gateway: str, workloads: dict[str, list], say) -> dict[str, tuple]:
    """Fresh replicas, the gateway in front, each workload in turn: {workload: (figures, extra)}."""
    spec = ClusterSpec(replicas=args.replicas, gateways=0, num_kv_blocks=args.num_kv_blocks,
                       max_num_seqs=args.max_num_seqs, enforce_eager=not args.compile)
    config = bench_config(spec, Path(tempfile.gettempdir()))  # Cluster gives it its own log dir
    if args.max_queue_delay_s is not None:
        config.engine["max_queue_delay_s"] = args.max_queue_delay_s
    out = {}
    with Cluster(config, say=say) as cluster:
        replicas = cluster.replica_urls
        log = cluster.log_dir / f"front-{gateway}.log"
        front, url = serve(gateway, replicas, log)
        try:
            for workload, jobs in workloads.items():
                before = asyncio.run(replica_counters(replicas))
                calls_before = asyncio.run(tokenize_calls(replicas))
                since = time.time()
                results = asyncio.run(replay(url + "/v1", None, jobs, args.window_s))
                counters = delta(asyncio.run(replica_counters(replicas)), before)
                row = figures(gateway, results, args.window_s, SLO())
                prompt = sum(c.prompt_tokens for c in counters)
                row.cached_ratio = (round(sum(c.cached_tokens for c in counters) / prompt, 4)
                                    if prompt else None)
                extra = {"tokenize_calls": asyncio.run(tokenize_calls(replicas)) - calls_before,
                         "tokenizer": tokenizer_modes(url, gateway), "log": str(log)}
                if (decided := routing_decisions(url, gateway, since)) is not None:
                    extra["reasons"] = dict(Counter(d["reason"] for d in decided))
                    extra["decisions"] = str(log.with_name(f"decisions-{workload}-{gateway}.json"))
                    Path(extra["decisions"]).write_text(json.dumps(decided))
                out[workload] = (row, extra)
        finally:
            front.terminate()
            try:
                front.wait(10)
            except subprocess.TimeoutExpired:
                front.kill()
    return out


def compare(rows: dict[str, ServerFigures]) -> dict:
    kv, smg = rows.get("kvgate"), rows.get("smg")
    if kv is None or smg is None:
        return {}
    ratio = lambda a, b: None if a is None or not b else round(a / b, 3)  # noqa: E731
    return {"ttft_p50_vs_smg": ratio(kv.ttft_p50_s, smg.ttft_p50_s),
            "ttft_p99_vs_smg": ratio(kv.ttft_p99_s, smg.ttft_p99_s),
            "cached_ratio_minus_smg": None if kv.cached_ratio is None or smg.cached_ratio is None
            else round(kv.cached_ratio - smg.cached_ratio, 4),
            "out_tok_s_vs_smg": ratio(kv.out_tok_s, smg.out_tok_s)}


def worst(per_workload: dict[str, dict]) -> dict:
    out = {}
    for key, pick in (("ttft_p50_vs_smg", max), ("ttft_p99_vs_smg", max),
                      ("cached_ratio_minus_smg", min), ("out_tok_s_vs_smg", min)):
        values = [c[key] for c in per_workload.values() if c.get(key) is not None]
        out[key] = pick(values) if values else None
    return out


def table(workload: str, rows: list[ServerFigures], ceiling: float) -> str:
    lines = [f"{workload} (cached-token ceiling {ceiling}: every prompt against all earlier ones):",
             "| gateway | finished | cached-token ratio | TTFT p50 / p99 (s) | out tok/s |",
             "|---|---|---|---|---|"]
    lines += [f"| {r.server} | {r.finished}/{r.requests} | {r.cached_ratio} | {r.ttft_p50_s} / "
              f"{r.ttft_p99_s} | {r.out_tok_s} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 (stdout: results)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    gateways = [g.strip() for g in args.gateways.split(",") if g.strip()]
    if unknown := (set(gateways) - set(GATEWAYS)) | (set(workloads) - set(WORKLOADS)):
        raise SystemExit(f"unknown gateway(s) or workload(s): {sorted(unknown)}")
    if "smg" in gateways:
        smg_binary()
    from transformers import AutoTokenizer

    from backend_engine.model_loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default").folder)
    words = single_token_words(tokenizer)
    jobs = {w: build(w, args.rows, words, args.output_tokens, args.speedup, args.rate,
                     args.max_input_tokens) for w in workloads}
    ceiling = {w: cache_ceilings(chat_prompts(js, tokenizer))["by_token"] for w, js in jobs.items()}
    for w, js in jobs.items():
        say(f"{w}: {len(js)} requests over {js[-1].arrival:.0f} s, cached-token ceiling {ceiling[w]}")
    rows: dict[str, dict[str, ServerFigures]] = {}
    extras: dict[str, dict] = {}
    started = time.monotonic()
    for gateway in gateways:
        for workload, (row, extra) in one_turn(args, gateway, jobs, say).items():
            rows.setdefault(workload, {})[gateway] = row
            extras[f"{workload}/{gateway}"] = extra
            say(f"  {workload} via {gateway}: {row.finished}/{row.requests} finished, cached "
                f"{row.cached_ratio}, TTFT p50 {row.ttft_p50_s} s p99 {row.ttft_p99_s} s, "
                f"{row.out_tok_s} out tok/s, {extra['tokenize_calls']} /tokenize calls "
                f"({time.monotonic() - started:.0f} s in)")
        time.sleep(2)  # let the last turn's processes leave the cores
    per_workload = {w: compare(r) for w, r in rows.items()}
    finished = {g: sum(r[g].finished for r in rows.values() if g in r) for g in gateways}
    summary = {**worst(per_workload), "requests": sum(len(j) for j in jobs.values()),
               **{f"{g}_finished": n for g, n in finished.items()},
               "per_workload": per_workload, "cached_ceiling": ceiling,
               "elapsed_s": round(time.monotonic() - started)}
    results_file.write("vs_smg", summary,
                       {"args": vars(args), "runs": {w: {g: f.to_dict() for g, f in r.items()}
                                                     for w, r in rows.items()}, "fronts": extras},
                       argv=argv, path=Path(args.out))
    for workload, by_gateway in rows.items():
        print(table(workload, list(by_gateway.values()), ceiling[workload]))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
