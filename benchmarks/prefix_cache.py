"""Prefix caching: TTFT of requests that share a long system prompt, cache on vs off.

16 requests of ~1,000 tokens whose first 60 % (then 80 %) is a shared system prompt, sent one
after another (steady state: the system prompt was seen once before the measured requests).
TTFT = time from add_request to the first generated token; medians are reported. Ends with one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from backend_engine.engine import LLMEngine
from backend_engine.config import EngineConfig
from backend_engine.sampling_params import SamplingParams
from benchmarks import results_file
from benchmarks.workloads import token_prompts


def ttft(engine: LLMEngine, request_id: str, tokens: list[int]) -> float:
    start = time.perf_counter()
    engine.add_request(request_id, tokens, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def measure(shared_share: float, total: int, count: int) -> tuple[float, float]:
    """Median TTFT with and without caching; requests alternate between the two engines so
    a slow moment of this shared machine hits both alike."""
    engines = [LLMEngine(EngineConfig(model="default", enable_prefix_caching=caching,
                                      max_num_batched_tokens=2048, num_kv_blocks=1024))
               for caching in (True, False)]
    tok = engines[0].tokenizer
    shared_len = int(total * shared_share)
    system = token_prompts(tok, 1, shared_len, seed=99)[0]
    users = token_prompts(tok, count + 1, total - shared_len, seed=1000)
    times: list[list[float]] = [[], []]
    for e in engines:
        ttft(e, "warm", system + users[-1])  # the system prompt has been seen once
    for i in range(count):
        for e, out in zip(engines, times):
            out.append(ttft(e, f"r{i}", system + users[i]))
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=16)
    args = ap.parse_args()
    result, ttft_ms = {}, {}
    for share in (0.6, 0.8):
        on, off = measure(share, args.prompt_tokens, args.requests)
        key = f"ttft_ratio_{int(share * 100)}"
        result[key] = round(on / off, 3)
        ttft_ms[key] = {"cached": round(on * 1000, 1), "uncached": round(off * 1000, 1)}
        print(f"shared {share:.0%}: TTFT cached {on * 1000:7.1f} ms, uncached {off * 1000:7.1f} ms"
              f" → ratio {on / off:.3f}")
    print(json.dumps(result))
    results_file.write("prefix_cache", result, {"args": vars(args), "ttft_p50_ms": ttft_ms})


if __name__ == "__main__":
    main()
