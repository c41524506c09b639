"""Prefill/decode disaggregation against colocation, same processes and cores.

Two clusters run the same open-loop workload, one after the other, each behind one gateway and
with one torch thread per replica:
  colocated  2 `both` replicas with chunked prefill (--max-num-batched-tokens, small chunks so
             a long prefill stalls the decodes it shares steps with as little as it can)
  pd         1 prefill replica (256-token chunks: it decodes nothing, and short prompts still
             get a turn between a long prompt's chunks) + 1 decode replica
The workload mixes streaming chat decodes (short prompt, long answer: what ITL is about) with
long-prompt requests (long prefill, short answer: what disturbs them). Reported per cluster:
decode ITL p50/p99 (gaps between streamed tokens of the chat requests), TTFT p50/p99, goodput
(requests meeting a TTFT and an ITL SLO, per second), throughput; for pd also the KV transfer
rate and per-request transfer time (from the gateway's /admin/api/pd). Last line: JSON with
`itl_p99_ratio` and `throughput_ratio` (pd / colocated).

    python -m benchmarks.pd_disagg [--model default] [--duration 60] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import tempfile
from pathlib import Path

import httpx

from benchmarks import results_file
from benchmarks.serve_bench_client import LoadClient, LoadSpec, RequestResult
from benchmarks.serve_bench_cluster import _free_base_port
from benchmarks.serve_bench_stats import percentile
from benchmarks.serve_bench_workloads import TOKEN_HIGH, TOKEN_LOW, Job, RequestSpec
from kvgate.launcher.config import UpConfig
from kvgate.launcher.plan import build_plan
from kvgate.launcher.supervisor import Supervisor


def workload(seed: int, duration_s: float, chat_rate: float, long_rate: float, chat_prompt: int,
             chat_output: int, long_prompt: int, long_output: int) -> list[Job]:
    """Poisson arrivals of both kinds; every prompt unique (no prefix cache help on either side)."""
    rng = random.Random(seed)
    jobs = []
    for kind, rate, prompt, output in (("chat", chat_rate, chat_prompt, chat_output),
                                       ("long", long_rate, long_prompt, long_output)):
        t = rng.expovariate(rate)
        while t < duration_s:
            tokens = [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(prompt)]
            jobs.append(Job([[RequestSpec(tokens, output, kind)]], t))
            t += rng.expovariate(rate)
    return sorted(jobs, key=lambda j: j.arrival)


def cluster_config(args: argparse.Namespace, pd: bool) -> UpConfig:
    engine = {"num_kv_blocks": args.num_kv_blocks, "max_num_seqs": 32,
              "max_num_batched_tokens": args.chunk_tokens}
    return UpConfig(model=args.model, replicas=0 if pd else 2, prefill_replicas=1 if pd else 0,
                    decode_replicas=1 if pd else 0, gateways=1, port=_free_base_port(8), device="cpu",
                    num_threads=1, engine=engine,
                    shutdown_grace_s=5.0, health_timeout_s=600.0, log_level="warning",
                    log_dir=tempfile.mkdtemp(prefix="pd-disagg-"),
                    admin_key="admin-" + secrets.token_hex(16))


class Cluster:
    def __init__(self, config: UpConfig, prefill_chunk_tokens: int) -> None:
        config.validate()
        self.config = config
        self.plan = build_plan(config, gpus=0, cores=2)
        for spec in self.plan.replicas:  # argparse keeps the last value of a repeated flag
            if spec.name.startswith("prefill"):
                spec.argv += ["--max-num-batched-tokens", str(prefill_chunk_tokens)]
        self.supervisor = Supervisor(self.plan, config, Path(config.log_dir), lambda m: None)

    @property
    def gateway(self) -> str:
        return self.plan.gateways[0].url

    def __enter__(self) -> "Cluster":
        self.supervisor.check_ports()
        if not self.supervisor.start():
            self.supervisor.stop()
            raise RuntimeError(f"cluster did not start; logs in {self.config.log_dir}")
        return self

    def __exit__(self, *exc) -> None:
        self.supervisor.stop()

    async def admin(self, path: str) -> dict:
        async with httpx.AsyncClient(timeout=10.0) as c:
            r = await c.get(self.gateway + "/admin/api" + path,
                            headers={"Authorization": f"Bearer {self.config.admin_key}"})
            return r.json()


def _p(values: list[float], q: float) -> float | None:
    return percentile(values, q)


def summarize(label: str, results: list[RequestResult], elapsed: float, slo_ttft: float,
              slo_itl: float) -> dict:
    ok = [r for r in results if r.ok]
    chat = [r for r in ok if r.group == "chat"]
    itl = [x for r in chat for x in r.itl]
    good = [r for r in ok if r.ttft <= slo_ttft and (_p(r.itl, 95) or 0.0) <= slo_itl]
    return {
        "label": label, "requests": len(results), "ok": len(ok), "elapsed_s": round(elapsed, 2),
        "itl_p50_s": _p(itl, 50), "itl_p99_s": _p(itl, 99),
        "ttft_p50_s": _p([r.ttft for r in ok], 50), "ttft_p99_s": _p([r.ttft for r in ok], 99),
        "chat_ttft_p99_s": _p([r.ttft for r in chat], 99),
        "long_ttft_p99_s": _p([r.ttft for r in ok if r.group == "long"], 99),
        "output_tok_per_s": sum(r.completion_tokens for r in ok) / elapsed,
        "req_per_s": len(ok) / elapsed, "goodput_req_per_s": len(good) / elapsed,
        "first_error": next((r.error for r in results if not r.ok), ""),
    }


async def run_one(cluster: Cluster, jobs: list[Job], args: argparse.Namespace, label: str) -> dict:
    spec = LoadSpec([cluster.gateway + "/v1"], args.model_id, concurrency=256, rate=1.0,
                    duration_s=args.duration, request_timeout_s=600.0)
    warm = LoadClient(LoadSpec([cluster.gateway + "/v1"], args.model_id, concurrency=2, rate=None,
                               duration_s=600.0))
    await warm.run(workload(args.seed + 1, 1.0, 2.0, 2.0, 32, 4, 64, 2)[:4])  # first-call costs
    client = LoadClient(spec)
    results = await client.run(jobs)
    out = summarize(label, results, client.elapsed, args.slo_ttft, args.slo_itl)
    if label == "pd":
        pd = await cluster.admin("/pd")
        out.update(transfer_bytes_per_s=pd["transfer_bytes"] / client.elapsed,
                   transfer_p50_s=pd["transfer_p50_s"], transfer_p99_s=pd["transfer_p99_s"],
                   pd_decisions=pd["decisions"], pd_failures=pd["failures"])
    return out


def fmt(s: dict) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f}"

    line = (f"[{s['label']:9s}] {s['ok']}/{s['requests']} ok · ITL p50/p99 {ms(s['itl_p50_s'])}/"
            f"{ms(s['itl_p99_s'])} ms · TTFT p50/p99 {ms(s['ttft_p50_s'])}/{ms(s['ttft_p99_s'])} ms "
            f"(chat p99 {ms(s['chat_ttft_p99_s'])}, long p99 {ms(s['long_ttft_p99_s'])}) · "
            f"{s['output_tok_per_s']:.1f} out tok/s · goodput {s['goodput_req_per_s']:.2f} req/s")
    if "transfer_p50_s" in s:
        line += (f"\n            KV {s['transfer_bytes_per_s'] / 1e6:.2f} MB/s · transfer p50/p99 "
                 f"{ms(s['transfer_p50_s'])}/{ms(s['transfer_p99_s'])} ms · {s['pd_decisions']}")
    if s["first_error"]:
        line += f"\n            first error: {s['first_error']}"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of arrivals per cluster")
    ap.add_argument("--chat-rate", type=float, default=0.3, help="chat requests per second")
    ap.add_argument("--long-rate", type=float, default=0.08, help="long-prompt requests per second")
    ap.add_argument("--chat-prompt", type=int, default=96)
    ap.add_argument("--chat-output", type=int, default=64)
    ap.add_argument("--long-prompt", type=int, default=1024)
    ap.add_argument("--long-output", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=64, help="colocated (and decode) prefill chunk")
    ap.add_argument("--prefill-chunk-tokens", type=int, default=256, help="the prefill replica's chunk")
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--slo-ttft", type=float, default=5.0, help="goodput: TTFT at most this (s)")
    ap.add_argument("--slo-itl", type=float, default=0.25, help="goodput: 95th-percentile ITL at most this (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny-random model, 15 s: a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.model, args.duration, args.chat_rate, args.long_rate = "tiny-random", 15.0, 2.0, 1.0
    jobs = workload(args.seed, args.duration, args.chat_rate, args.long_rate, args.chat_prompt,
                    args.chat_output, args.long_prompt, args.long_output)
    print(f"pd_disagg: {sum(j.stages[0][0].group == 'chat' for j in jobs)} chat + "
          f"{sum(j.stages[0][0].group == 'long' for j in jobs)} long-prompt requests over "
          f"{args.duration:.0f}s, model {args.model}, 2 replicas x 1 thread, 1 gateway", flush=True)
    summaries = {}
    for label, pd in (("colocated", False), ("pd", True)):
        with Cluster(cluster_config(args, pd), args.prefill_chunk_tokens) as cluster:
            args.model_id = asyncio.run(_model_id(cluster))
            summaries[label] = asyncio.run(run_one(cluster, jobs, args, label))
        print(fmt(summaries[label]), flush=True)
    co, pd = summaries["colocated"], summaries["pd"]
    summary = {
        "itl_p99_ratio": _ratio(pd["itl_p99_s"], co["itl_p99_s"]),
        "throughput_ratio": _ratio(pd["output_tok_per_s"], co["output_tok_per_s"]),
        "ttft_p99_ratio": _ratio(pd["ttft_p99_s"], co["ttft_p99_s"]),
        "goodput_ratio": _ratio(pd["goodput_req_per_s"], co["goodput_req_per_s"]),
        "colocated": co, "pd": pd, "model": args.model, "duration_s": args.duration}
    print(json.dumps(summary))
    results_file.write("pd_disagg", summary, {"args": vars(args)},
                       name="pd_disagg_quick" if args.quick else None)


async def _model_id(cluster: Cluster) -> str:
    async with httpx.AsyncClient(timeout=10.0) as c:
        return (await c.get(cluster.gateway + "/v1/models")).json()["data"][0]["id"]


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


if __name__ == "__main__":
    main()
