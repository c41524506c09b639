"""Replay rows of a public Mooncake trace as streaming chat against `kvgate up` and, in the same
run on the same cores, llama.cpp's `llama-server` on the same GGUF (continuous batching over
`--parallel` slots, threads = cores). Each server gets the same requests at the same times and
the same window; what has not finished by the window's end is cut off.

    python -m benchmarks.trace_load                     # 150 rows, 3x, 8.5-minute window
    python -m benchmarks.trace_load --rows 40 --window-s 120 --servers kvgate

Per server: requests finished in the window, goodput (finished with TTFT <= 10 s and mean ITL
<= 250 ms), output and prompt tokens/s, TTFT and ITL p50/p99, cached-token ratio; a table, a plot
(TTFT CDF, tokens/s over time) and, last, one JSON line of kvgate / llama.cpp ratios, with the
cached ratio an unbounded cache could reach on these prompts by whole blocks and by token
(benchmarks/cache_ceiling.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path

from backend_engine.config import EngineConfig
from benchmarks import results_file
from benchmarks.cache_ceiling import cache_ceilings, chat_prompts
from benchmarks.llamacpp_server import LlamaServer
from benchmarks.serve_bench_client import LoadClient, LoadSpec, discover_model
from benchmarks.serve_bench_workloads import Job
from benchmarks.trace_load_report import SLO, ServerFigures, figures, plot, table
from benchmarks.trace_load_workload import single_token_words, trace_jobs, trace_path
from kvgate.launcher.plan import DEFAULT_CPU_REPLICAS

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.trace_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="conversation",
                   help="conversation, synthetic (the _bs16 copies in benchmarks/data/traces) or a JSONL path")
    p.add_argument("--rows", type=int, default=150, help="first N rows of the trace")
    p.add_argument("--speedup", type=float, default=3.0, help="arrivals this many times faster than recorded")
    p.add_argument("--window-s", type=float, default=510.0, help="per server; unfinished requests are cut off")
    p.add_argument("--servers", default="kvgate,llamacpp", help="comma-separated: kvgate, llamacpp")
    p.add_argument("--model", default="default",
                   help='both servers\' model: "default" (SmolLM2-135M-Instruct), "gemma3-270m" or a '
                        '.gguf file (llama.cpp serves the same file; kvgate alone: any --model)')
    p.add_argument("--replicas", type=int, default=None, help="kvgate replicas (default: kvgate up's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per replica (default: kvgate up's)")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of every replica (kvgate up's `engine:` keys), e.g. dtype=bfloat16 "
                        "(repeat)")
    p.add_argument("--quantization", default=None, help="every replica's weights (kvgate up --quantization)")
    p.add_argument("--llamacpp-parallel", type=int, default=16, help="llama-server --parallel slots")
    p.add_argument("--ttft-slo-s", type=float, default=10.0)
    p.add_argument("--itl-slo-ms", type=float, default=250.0)
    p.add_argument("--out", default=None,
                   help="prefix of the .json/.md/.png written (default: results/trace_load, with "
                        "_MODEL for another model)")
    args = p.parse_args(argv)
    if args.out is None:
        stem = "" if args.model == "default" else "_" + Path(args.model).stem
        args.out = str(RESULTS / f"trace_load{stem}")
    return args


def engine_flags(args: argparse.Namespace) -> dict:
    """The replicas' settings: --engine's, and unless they size the KV pool, the KV tokens
    llama-server gets (--parallel slots x its context per slot) split over the replicas, so
    both servers hold as many tokens of cache (kvgate's in its compute dtype, fp32 by default
    on CPU, llama.cpp's in f16)."""
    flags = {}
    for item in args.engine:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine wants KEY=VALUE, not {item!r}")
        flags[key.replace("-", "_")] = value
    if not {"num_kv_blocks", "kv_cache_memory_gb"} & flags.keys():
        replicas = args.replicas or DEFAULT_CPU_REPLICAS
        tokens = args.llamacpp_parallel * LlamaServer.ctx_per_slot
        block_size = EngineConfig.__dataclass_fields__["block_size"].default
        flags["num_kv_blocks"] = tokens // replicas // block_size
    return flags


async def replay(base_url: str, api_key: str | None, jobs: list[Job], window_s: float):
    model = await discover_model(base_url, api_key)
    spec = LoadSpec([base_url], model, api_key, concurrency=max(1, len(jobs)),
                    rate=1.0,  # not None: open loop, each job at its arrival time
                    duration_s=window_s, request_timeout_s=window_s, window_s=window_s)
    client = LoadClient(spec)
    return await client.run(jobs)


def run_kvgate(args, jobs: list[Job], say) -> list:
    from benchmarks.serve_bench_cluster import Cluster
    from kvgate.launcher.config import UpConfig

    config = UpConfig(model=args.model, replicas=args.replicas, num_threads=args.threads,
                      quantization=args.quantization, engine=engine_flags(args),
                      log_level="warning", health_timeout_s=900.0)
    with Cluster(config, say=say) as cluster:
        say(f"kvgate up: {len(cluster.replica_urls)} replicas, gateway {cluster.gateway_urls[0]}, "
            f"logs in {cluster.log_dir}")
        return asyncio.run(replay(cluster.base_urls[0], cluster.api_key, jobs, args.window_s))


def run_llamacpp(args, jobs: list[Job], say) -> list:
    from backend_engine.model_loader import gguf_file

    gguf = gguf_file(args.model)
    if gguf is None:
        raise SystemExit(f"llama.cpp serves GGUF files; --model {args.model!r} is not one "
                         "(run with --servers kvgate)")
    server = LlamaServer(gguf=gguf, parallel=args.llamacpp_parallel, say=say)
    with server as base_url:
        say(f"llama-server: {shlex.join(server.command(Path('.')))[:200]} …")
        return asyncio.run(replay(base_url, None, jobs, args.window_s))


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or not b:
        return None
    return round(a / b, 3)


def headline(kv: ServerFigures | None, ll: ServerFigures | None, requests: int) -> dict:
    out: dict = {"requests": requests,
                 "kvgate_finished": kv.finished if kv else None,
                 "llamacpp_finished": ll.finished if ll else None}
    out["kvgate_goodput"] = kv.goodput if kv else None
    out["llamacpp_goodput"] = ll.goodput if ll else None  # the ratio is null when this is 0
    if kv and ll:
        out.update(goodput_vs_llamacpp=ratio(kv.goodput, ll.goodput),
                   out_tok_s_vs_llamacpp=ratio(kv.out_tok_s, ll.out_tok_s),
                   ttft_p99_vs_llamacpp=ratio(kv.ttft_p99_s, ll.ttft_p99_s),
                   itl_p99_vs_llamacpp=ratio(kv.itl_p99_ms, ll.itl_p99_ms))
    out["cached_ratio"] = kv.cached_ratio if kv else None
    if ll:
        out["llamacpp_cached_ratio"] = ll.cached_ratio
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 (stdout: results)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = set(servers) - {"kvgate", "llamacpp"}
    if unknown:
        raise SystemExit(f"unknown server(s) {sorted(unknown)}; choose kvgate, llamacpp")
    from transformers import AutoTokenizer

    from backend_engine.model_loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model).folder)
    jobs = trace_jobs(trace_path(args.trace), args.rows, args.speedup,
                      single_token_words(tokenizer))
    say(f"{len(jobs)} requests over {jobs[-1].arrival:.1f} s, window {args.window_s:.0f} s")
    slo = SLO(args.ttft_slo_s, args.itl_slo_ms / 1000)
    runners = {"kvgate": run_kvgate, "llamacpp": run_llamacpp}
    runs, rows = {}, {}
    for server in servers:
        started = time.monotonic()
        runs[server] = runners[server](args, jobs, say)
        rows[server] = figures(server, runs[server], args.window_s, slo)
        say(f"{server}: {rows[server].finished}/{len(jobs)} finished, goodput "
            f"{rows[server].goodput}, {rows[server].out_tok_s} out tok/s "
            f"({time.monotonic() - started:.0f} s)")
        time.sleep(3)  # let the last server's processes leave the cores
    result = headline(rows.get("kvgate"), rows.get("llamacpp"), len(jobs))
    # the cached ratios above against what an unbounded cache could serve of these prompts
    ceilings = cache_ceilings(chat_prompts(jobs, tokenizer))
    result.update(cached_ceiling_whole_blocks=ceilings["whole_blocks"],
                  cached_ceiling_by_token=ceilings["by_token"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = results_file.command("trace_load", argv)
    png = plot(out.with_suffix(".png"), runs, args.window_s)
    md = (f"# trace_load\n\n`{command}`\n\n{len(jobs)} requests of `{args.trace}`, "
          f"{args.speedup}x, window {args.window_s:.0f} s, SLO TTFT <= {slo.ttft_s} s and mean "
          f"ITL <= {slo.mean_itl_s * 1000:.0f} ms\n\n{table(list(rows.values()))}\n\n"
          f"![plot]({png.name})\n")
    out.with_suffix(".md").write_text(md)
    results_file.write("trace_load", result, {"args": vars(args), "engine": engine_flags(args),
                                              "servers": {k: v.to_dict() for k, v in rows.items()}},
                       argv=argv, path=out.with_suffix(".json"))
    print(table(list(rows.values())))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
