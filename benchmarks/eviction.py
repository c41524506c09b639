"""Eviction: a rare valuable prefix in a flood of one-off prompts, plain LRU vs SLRU.

A small KV pool serves a seeded stream of requests: mostly one-off prompts (never seen again),
some moderately shared prefixes (a Zipf-like popularity over a handful of them), and a long
valuable system prompt used only every ~N requests. The same stream runs on three engines:
plain LRU without pins; segmented LRU (slru, scan-resistant) without pins; and slru with the
valuable prefix pinned through the admin path (a prefill-only warm-up, then a pin).
Hit rate = prompt tokens the engine served from its prefix cache over prompt tokens sent.
Prints a table, then one line of JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from dataclasses import dataclass

from backend_engine.async_engine import AsyncLLMEngine
from backend_engine.config import EngineConfig
from backend_engine.sampling_params import SamplingParams
from benchmarks import results_file

VALUABLE, SHARED, ONE_OFF = "valuable", "shared", "one-off"


@dataclass(slots=True)
class Request:
    kind: str
    tokens: list[int]
    prefix_len: int  # tokens a perfect cache could serve (the shared or valuable prefix)


@dataclass(slots=True)
class Workload:
    valuable_prefix: list[int]
    requests: list[Request]


def build_workload(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    valuable = tokens(args.valuable_tokens)
    shared = [tokens(args.shared_tokens) for _ in range(args.shared_prefixes)]
    weights = [1 / (rank + 1) for rank in range(args.shared_prefixes)]  # Zipf, s = 1
    requests = []
    for i in range(args.requests):
        if i % args.valuable_every == args.valuable_every // 2:
            requests.append(Request(VALUABLE, valuable + tokens(args.suffix_tokens), len(valuable)))
        elif rng.random() < args.shared_share:
            prefix = rng.choices(shared, weights)[0]
            requests.append(Request(SHARED, prefix + tokens(args.suffix_tokens), len(prefix)))
        else:
            requests.append(Request(ONE_OFF, tokens(args.one_off_tokens), 0))
    return Workload(valuable, requests)


@dataclass(slots=True)
class Tally:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    valuable_prefix_tokens: int = 0
    valuable_prefix_hits: int = 0
    shared_prefix_tokens: int = 0
    shared_prefix_hits: int = 0

    def add(self, request: Request, cached: int) -> None:
        self.prompt_tokens += len(request.tokens)
        self.cached_tokens += cached
        if request.kind == VALUABLE:
            self.valuable_prefix_tokens += request.prefix_len
            self.valuable_prefix_hits += min(cached, request.prefix_len)
        elif request.kind == SHARED:
            self.shared_prefix_tokens += request.prefix_len
            self.shared_prefix_hits += min(cached, request.prefix_len)

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def valuable_hit(self) -> float:
        return self.valuable_prefix_hits / self.valuable_prefix_tokens

    @property
    def shared_hit(self) -> float:
        return self.shared_prefix_hits / self.shared_prefix_tokens


async def _cached_tokens(engine: AsyncLLMEngine, request_id: str, tokens: list[int]) -> int:
    params = SamplingParams(temperature=0, max_tokens=1)
    last = None
    async for out in engine.generate(tokens, params, request_id):
        last = out
    return last.num_cached_tokens


async def _send(engine: AsyncLLMEngine, workload: Workload, concurrency: int) -> Tally:
    """Requests go out in order, `concurrency` at a time (a wave finishes before the next)."""
    tally = Tally()
    requests = workload.requests
    for start in range(0, len(requests), concurrency):
        wave = requests[start:start + concurrency]
        cached = await asyncio.gather(*(_cached_tokens(engine, f"r{start + i}", r.tokens)
                                        for i, r in enumerate(wave)))
        for request, hit in zip(wave, cached):
            tally.add(request, hit)
    return tally


async def run(args: argparse.Namespace, policy: str, pin: bool) -> tuple[Tally, dict]:
    engine = AsyncLLMEngine(EngineConfig(
        model=args.model, num_kv_blocks=args.kv_blocks, max_num_batched_tokens=2048,
        eviction_policy=policy, max_pinned_fraction=args.max_pinned_fraction))
    await engine.start()
    try:
        workload = build_workload(args, engine.engine.hf_config.vocab_size)
        if pin:
            await engine.pin("valuable", workload.valuable_prefix, excerpt="valuable system prompt")
        tally = await _send(engine, workload, args.concurrency)
        return tally, engine.pin_capacity()
    finally:
        await engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--kv-blocks", type=int, default=256, help="KV pool size (blocks of 16)")
    ap.add_argument("--requests", type=int, default=1200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--valuable-every", type=int, default=40)
    ap.add_argument("--valuable-tokens", type=int, default=512)
    ap.add_argument("--shared-prefixes", type=int, default=8)
    ap.add_argument("--shared-tokens", type=int, default=256)
    ap.add_argument("--shared-share", type=float, default=0.4)
    ap.add_argument("--one-off-tokens", type=int, default=320)
    ap.add_argument("--suffix-tokens", type=int, default=48)
    ap.add_argument("--max-pinned-fraction", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rows = {}
    for label, policy, pin in (("lru", "lru", False), ("slru, no pin", "slru", False),
                               ("slru + pin", "slru", True)):
        rows[label] = asyncio.run(run(args, policy, pin))
    print(f"{'engine':<16} {'valuable hit':>12} {'shared hit':>10} {'overall hit':>11} "
          f"{'pinned blocks':>13}")
    for label, (t, cap) in rows.items():
        print(f"{label:<16} {t.valuable_hit:>12.3f} {t.shared_hit:>10.3f} {t.hit_ratio:>11.3f} "
              f"{cap['pinned_blocks']:>6}/{cap['max_pinned_blocks']:<6}")
    lru, pinned = rows["lru"][0], rows["slru + pin"][0]
    summary = {"valuable_prefix_hit_lru": round(lru.valuable_hit, 3),
               "valuable_prefix_hit_slru_pin": round(pinned.valuable_hit, 3),
               "overall_hit_ratio_vs_lru": round(pinned.hit_ratio / lru.hit_ratio, 3)}
    print(json.dumps(summary))
    table = {label: {"valuable_hit": round(t.valuable_hit, 3), "shared_hit": round(t.shared_hit, 3),
                     "overall_hit": round(t.hit_ratio, 3), **cap} for label, (t, cap) in rows.items()}
    results_file.write("eviction", summary, {"args": vars(args), "engines": table})


if __name__ == "__main__":
    main()
