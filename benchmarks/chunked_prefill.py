"""Chunked prefill: inter-token latency of running decodes while long prompts arrive.

8 requests are decoding when 2,000-token prompts arrive (one every `--gap` decode steps).
Unchunked: the step budget holds a whole prompt, so every decode stalls for a full prefill.
Chunked: a budget of `--chunk` tokens per step, shared by decodes and prefill chunks.
Reports p99 inter-token latency of the 8 decodes and total throughput (prompt + generated
tokens per second). Ends with one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import time

from backend_engine.config import EngineConfig
from backend_engine.engine import LLMEngine
from backend_engine.sampling_params import SamplingParams
from benchmarks import results_file
from benchmarks.workloads import token_prompts


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(budget: int, args) -> tuple[float, float]:
    engine = LLMEngine(EngineConfig(model="default", max_num_batched_tokens=budget,
                                    num_kv_blocks=1024, max_num_seqs=16))
    tok = engine.tokenizer
    decodes = token_prompts(tok, 8, 64, seed=5)
    longs = token_prompts(tok, args.long_prompts, args.long_tokens, seed=500)
    decode_params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    for i, p in enumerate(decodes):
        engine.add_request(f"d{i}", p, decode_params)
    last_token_at: dict[str, float] = {}
    gaps: list[float] = []
    steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        arrived = steps // args.gap
        if steps % args.gap == 0 and 1 <= arrived <= len(longs):
            engine.add_request(f"long{arrived}", longs[arrived - 1],
                               SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outs:
            if out.request_id.startswith("d") and out.outputs[0].delta_token_ids:
                if out.request_id in last_token_at:
                    gaps.append(now - last_token_at[out.request_id])
                last_token_at[out.request_id] = now
    elapsed = time.perf_counter() - start
    processed = 8 * (64 + args.decode_tokens) + len(longs) * (args.long_tokens + 4)
    return percentile(gaps, 0.99), processed / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--long-prompts", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--gap", type=int, default=20, help="decode steps between long prompts")
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()
    p99_chunked, tput_chunked = run(args.chunk, args)
    p99_whole, tput_whole = run(args.long_tokens + 64, args)
    print(f"chunked ({args.chunk}/step): p99 ITL {p99_chunked * 1000:7.1f} ms, "
          f"{tput_chunked:7.1f} tok/s")
    print(f"unchunked          : p99 ITL {p99_whole * 1000:7.1f} ms, {tput_whole:7.1f} tok/s")
    summary = {"p99_itl_ratio": round(p99_chunked / p99_whole, 3),
               "throughput_ratio": round(tput_chunked / tput_whole, 3)}
    print(json.dumps(summary))
    results_file.write("chunked_prefill", summary, {
        "args": vars(args), "chunked": {"p99_itl_ms": round(p99_chunked * 1000, 1), "tok_s": round(tput_chunked, 1)},
        "whole": {"p99_itl_ms": round(p99_whole * 1000, 1), "tok_s": round(tput_whole, 1)}})


if __name__ == "__main__":
    main()
