"""Speed of quantised weights: kvgate fp32 / bf16 / int8 / int4 against llama.cpp's llama-server
on the same GGUF (SmolLM2-135M-Instruct Q4_1; `--model gemma3-270m`: Gemma 3 270M Q4_K_M), one
run, the same threads for every server.

Every server is started first (one kvgate replica per format through `kvgate up --gateways 0`,
and llama-server with 16 parallel slots); then they are measured in turn, request by request or
wave by wave, each while the others stand idle, with the same streaming /v1/completions client:
- decode tok/s at c=1: requests one after another, (output tokens - 1) / (end - first token);
- aggregate tok/s at c=16: 16 concurrent requests, all output tokens / wall time;
- prefill tok/s: one ~1,000-token prompt at a time, max_tokens=1, prompt tokens / time;
- weight MB: what the replica's model holds (the GGUF's size for llama.cpp).
Interleaved, a server's figure and its neighbour's come from the same minutes: a shared
machine's speed drifts from one quarter-hour to the next, and servers measured one after the
other gave ratios that swung more between runs than the servers differ.
Prompts are distinct ~110-token windows of the evaluation text (no prefix-cache hits), outputs
128 tokens (ignore_eos). kvgate's quantised rows run with --dtype bfloat16 (the CPU kernels'
activation dtype). Both servers run their OpenMP workers with libgomp's default spin (each has
the cores to itself; `--omp-spin-count` changes kvgate's). The quantised rows' lm_head is the
plan's for this CPU (backend_engine/accel/plan.py: w8a8, int8 weights times int8 activations
as llama.cpp computes its Q8_0 output, on every CPU class);
`int4-lm8` is int4 with `--engine-option lm_head=int8` (weight-only), `int4-lm4` with `int4`.
Ends with one line of JSON with int4_c1_vs_llamacpp and int4_c16_vs_llamacpp (and the
int4_lm8_ and int4_lm4_ ones).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import time
from contextlib import ExitStack

import httpx

from benchmarks import results_file
from benchmarks.quant_quality import TEXT, weight_bytes
from benchmarks.serve_bench_client import open_stream

FORMATS = {"fp32": dict(dtype="float32", quantization="none"),
           "bf16": dict(dtype="bfloat16", quantization="none"),
           "int8": dict(dtype="bfloat16", quantization="int8"),
           "int4": dict(dtype="bfloat16", quantization="int4"),
           "int4-lm8": dict(dtype="bfloat16", quantization="int4",
                            engine_options={"lm_head": "int8"}),
           "int4-lm4": dict(dtype="bfloat16", quantization="int4",
                            engine_options={"lm_head": "int4"})}
PROMPT_TOKENS, LONG_PROMPT_TOKENS = 110, 1000


def prompt_texts(count: int, tokens: int, offset: int = 0, model: str = "default") -> list[str]:
    from transformers import AutoTokenizer

    from backend_engine.model_loader import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(model).folder)
    ids = tok.encode(TEXT.read_text())
    step = max(1, (len(ids) - tokens) // max(count, 1))
    return [f"[{offset + i}] " + tok.decode(ids[i * step: i * step + tokens]) for i in range(count)]


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str,
               max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    chunks = 0
    usage = None
    async with open_stream(client, url + "/completions", body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                usage = data["usage"]
            if data.get("choices") and data["choices"][0].get("text"):
                chunks += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    tokens = (usage or {}).get("completion_tokens") or chunks
    prompt_tokens = (usage or {}).get("prompt_tokens")
    return {"start": start, "first": first or end, "end": end, "tokens": tokens,
            "prompt_tokens": prompt_tokens}


async def measure(urls: dict[str, str], args) -> dict[str, dict]:
    """Each server's figures, the servers taking turns (the first of each turn alternating)."""
    names = list(urls)
    c1 = {name: [] for name in names}
    wave = {name: {} for name in names}
    long = {name: [] for name in names}
    async with httpx.AsyncClient(timeout=1800) as client:
        models = {name: (await client.get(url + "/models")).json()["data"][0]["id"]
                  for name, url in urls.items()}

        async def one(name: str, prompt: str, max_tokens: int) -> dict:
            return await _one(client, urls[name], models[name], prompt, max_tokens)

        for name in names:
            await one(name, "Hello", 4)  # warm up
        for i, prompt in enumerate(prompt_texts(args.c1_requests, PROMPT_TOKENS, 100, args.model)):
            for name in names[i % 2:] + names[:i % 2]:
                c1[name].append(await one(name, prompt, args.max_tokens))
        prompts = prompt_texts(args.concurrency, PROMPT_TOKENS, 200, args.model)
        for name in names:
            start = time.perf_counter()
            results = await asyncio.gather(*[one(name, p, args.max_tokens) for p in prompts])
            wave[name] = {"results": results, "wall": time.perf_counter() - start}
        for i, prompt in enumerate(prompt_texts(args.prefill_requests, LONG_PROMPT_TOKENS, 300,
                                                args.model)):
            for name in names[i % 2:] + names[:i % 2]:
                long[name].append(await one(name, prompt, 1))
    rows = {}
    for name in names:
        decode = [(r["tokens"] - 1) / (r["end"] - r["first"]) for r in c1[name] if r["tokens"] > 1]
        prefill_tokens = sum(r["prompt_tokens"] or LONG_PROMPT_TOKENS for r in long[name])
        rows[name] = {
            "c1_tok_s": sum(decode) / len(decode),
            "c16_tok_s": sum(r["tokens"] for r in wave[name]["results"]) / wave[name]["wall"],
            "prefill_tok_s": prefill_tokens / sum(r["end"] - r["start"] for r in long[name])}
    return rows


def kvgate_replica(name: str, flags: dict, args, stack: ExitStack, say) -> tuple[str, float]:
    """Start one kvgate replica of a format; its /v1 URL and the model's weight MB."""
    from backend_engine.llm import LLM
    from benchmarks.serve_bench_cluster import Cluster
    from kvgate.launcher.config import UpConfig

    llm = LLM(args.model, num_kv_blocks=16, **flags)  # in-process, only to count weight bytes
    mb = weight_bytes(llm.engine.runner) / 1e6
    del llm
    gc.collect()
    # no admission bound: a shared, loaded machine must slow the run down, not refuse it
    engine = {"dtype": flags["dtype"], "max_num_seqs": 32, "num_kv_blocks": 2048,
              "max_queue_delay_s": 3600,
              **{k: v for k, v in flags.items() if k == "engine_options"}}
    # each server has the cores to itself: kvgate's workers spin as long as llama-server's
    os.environ["GOMP_SPINCOUNT"] = str(args.omp_spin_count)
    config = UpConfig(model=args.model, replicas=1, gateways=0, num_threads=args.threads,
                      quantization=flags.get("quantization"), engine=engine,
                      log_level="warning", health_timeout_s=900.0)
    say(f"starting kvgate {name}")
    cluster = stack.enter_context(Cluster(config, say=say))
    return cluster.replica_urls[0] + "/v1", mb


def llamacpp_server(args, stack: ExitStack, say) -> tuple[str, float] | None:
    """Start llama-server on the GGUF; its /v1 URL and the file's MB (None if it cannot run)."""
    from benchmarks.llamacpp_server import LlamaServer, LlamaServerUnavailable

    from backend_engine.model_loader import gguf_file

    server = LlamaServer(gguf=gguf_file(args.model), parallel=args.concurrency,
                         threads=args.threads, say=say)
    try:
        url = stack.enter_context(server)
    except LlamaServerUnavailable as exc:
        say(f"llama.cpp skipped: {exc}")
        return None
    return url, server.gguf.stat().st_size / 1e6


def llamacpp_label(gguf) -> str:
    """The GGUF's weight type, from its `general.file_type` (Q4_1, Q4_K_M, …)."""
    from gguf import LlamaFileType

    from backend_engine.quant.gguf import read_gguf

    field = read_gguf(gguf).fields.get("general.file_type")
    return LlamaFileType(field.contents()).name.removeprefix("MOSTLY_") if field else "GGUF"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default",
                    help='"default" (SmolLM2-135M-Instruct), "gemma3-270m" or a .gguf file')
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--c1-requests", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prefill-requests", type=int, default=3)
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--omp-spin-count", type=int, default=300000,
                    help="GOMP_SPINCOUNT of the kvgate replicas (default: libgomp's own, which "
                         "llama-server runs with; kvgate's default is 1000)")
    args = ap.parse_args()
    from backend_engine.model_loader import gguf_file

    gguf = gguf_file(args.model)
    if gguf is None:
        ap.error(f"--model {args.model!r} is not a GGUF checkpoint (llama.cpp serves the same file)")
    llamacpp = f"llama.cpp {llamacpp_label(gguf)}"

    def say(message: str) -> None:
        print(message, flush=True)

    servers: dict[str, tuple[str, float]] = {}  # name -> (URL, weight MB)
    with ExitStack() as stack:
        if not args.no_llamacpp:
            started = llamacpp_server(args, stack, say)
            if started:
                servers[llamacpp] = started
        for name in args.formats.split(","):
            servers[f"kvgate {name}"] = kvgate_replica(name, FORMATS[name], args, stack, say)
        figures = asyncio.run(measure({name: url for name, (url, _) in servers.items()}, args))
    rows = [{"server": name, "weight_mb": mb, **figures[name]} for name, (_, mb) in servers.items()]
    for row in rows:
        say(json.dumps(row))
    ll = next((r for r in rows if r["server"] == llamacpp), None)
    by = {r["server"]: r for r in rows}
    summary = {"model": args.model, "threads": args.threads, "rows": rows}
    for name in ("int4", "int4-lm8", "int4-lm4"):
        row, key = by.get(f"kvgate {name}"), name.replace("-", "_")
        if row and ll:
            summary[f"{key}_c1_vs_llamacpp"] = round(row["c1_tok_s"] / ll["c1_tok_s"], 3)
            summary[f"{key}_c16_vs_llamacpp"] = round(row["c16_tok_s"] / ll["c16_tok_s"], 3)
    print(json.dumps(summary))
    name = "quant_speed" if args.model == "default" else f"quant_speed_{gguf.stem}"
    results_file.write("quant_speed", summary, {"args": vars(args)}, name=name)


if __name__ == "__main__":
    main()
