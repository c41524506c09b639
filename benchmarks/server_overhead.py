"""What the HTTP server costs: the same requests through a replica (streaming, openai SDK) and
through the offline engine, both capped at the same concurrency.

    python -m benchmarks.server_overhead [--model default] [--requests 32] [--concurrency 16]

The last line is JSON: {"server_vs_offline_throughput", "ttft_p50_ms", "tpot_p50_ms", ...}.
Output tokens are forced (ignore_eos) so both sides do identical work; prompts are distinct
random token ids so the prefix cache plays no part. Both engines run with one torch thread by
default: the ratio measures the server, not kernel scaling, and multi-threaded torch degrades
erratically on a CPU shared with other processes.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx

from benchmarks import results_file


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="timed runs per side; the best counts (noise on a shared CPU only slows)")
    p.add_argument("--num-threads", type=int, default=1,
                   help="torch threads for both engines (1: robust on a shared CPU; 0: torch's default)")
    return p.parse_args(argv)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {"max_num_seqs": args.concurrency, "num_kv_blocks": args.num_kv_blocks, "device": args.device,
            "num_threads": args.num_threads or None}


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    high = min(vocab, 30000)
    return [[rng.randrange(100, high) for _ in range(args.prompt_len)] for _ in range(args.requests)]


def run_offline(args: argparse.Namespace) -> tuple[float, list[list[int]]]:
    """Generated tokens per second of LLM.generate over all requests (best of the rounds)."""
    from backend_engine.llm import LLM
    from backend_engine.sampling_params import SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    prompts = make_prompts(args, len(llm.tokenizer))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    best = 0.0
    for _ in range(args.rounds):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        best = max(best, sum(len(c.token_ids) for o in outputs for c in o.outputs) / elapsed)
    del llm
    gc.collect()
    return best, prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replica(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvgate.cli", "engine", "--model", args.model, "--port", str(port),
           "--max-num-seqs", str(args.concurrency), "--num-kv-blocks", str(args.num_kv_blocks),
           "--device", args.device, "--log-level", "warning"]
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    proc = subprocess.Popen(cmd, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"replica exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError("replica did not become ready")


async def one_request(client, model: str, prompt: list[int], output_len: int) -> dict:
    sent = time.perf_counter()
    token_times: list[float] = []
    completion_tokens = 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=output_len, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            token_times.append(time.perf_counter())
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
    ttft = token_times[0] - sent
    tpot = (token_times[-1] - token_times[0]) / max(1, completion_tokens - 1)
    return {"ttft": ttft, "tpot": tpot, "tokens": completion_tokens}


async def run_server(args: argparse.Namespace, prompts: list[list[int]], base_url: str) -> tuple[float, list[dict]]:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:
        model = (await client.models.list()).data[0].id
        await one_request(client, model, prompts[0][:16], 8)  # warm-up
        gate = asyncio.Semaphore(args.concurrency)

        async def bounded(prompt: list[int]) -> dict:
            async with gate:
                return await one_request(client, model, prompt, args.output_len)

        best: tuple[float, list[dict]] = (0.0, [])
        for _ in range(args.rounds):
            start = time.perf_counter()
            results = await asyncio.gather(*(bounded(p) for p in prompts))
            elapsed = time.perf_counter() - start
            best = max(best, (sum(r["tokens"] for r in results) / elapsed, results), key=lambda b: b[0])
    return best


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    offline_tps, prompts = run_offline(args)
    print(f"offline: {offline_tps:.1f} generated tokens/s", flush=True)
    port = free_port()
    proc = start_replica(args, port)
    try:
        server_tps, results = asyncio.run(run_server(args, prompts, f"http://127.0.0.1:{port}/v1"))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"server:  {server_tps:.1f} generated tokens/s", flush=True)
    summary = {
        "server_vs_offline_throughput": round(server_tps / offline_tps, 3),
        "ttft_p50_ms": round(statistics.median(r["ttft"] for r in results) * 1000, 1),
        "tpot_p50_ms": round(statistics.median(r["tpot"] for r in results) * 1000, 2),
        "server_tokens_per_s": round(server_tps, 1),
        "offline_tokens_per_s": round(offline_tps, 1),
        "requests": args.requests,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "model": args.model,
    }
    print(json.dumps(summary), flush=True)
    results_file.write("server_overhead", summary, {"args": vars(args)}, argv=argv)
    return summary


if __name__ == "__main__":
    main()
