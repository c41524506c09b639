"""Routing decision latency: `python -m benchmarks.routing_latency`.

4k-token prompts, 16 replicas, the prefix-cost policy: block hashing + index match + policy + writing
predicted entries + booking load, per request. Once in memory, once through Redis (a
redis-server started on a free port, if the binary exists). Prints one JSON line per mode:
{"p50_us": ..., "p99_us": ..., "mode": ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import socket
import subprocess
import tempfile
import time

from benchmarks import results_file
from routing.hashing import block_hashes
from routing.redis_store import RedisStore
from routing.router import Router
from routing.shared_router import SharedRouter

PROMPT_TOKENS = 4096
REPLICAS = 16


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    # 32 shared 3k-token prefixes + a unique 1k tail: realistic partial matches on every replica.
    prefixes = [[rng.randrange(50_000) for _ in range(3072)] for _ in range(32)]
    return [rng.choice(prefixes) + [rng.randrange(50_000) for _ in range(PROMPT_TOKENS - 3072)]
            for _ in range(n)]


class _Clock:
    """Simulated time, 1 ms per request: the index lives in steady state at 1,000 requests/s
    (predicted entries written and expiring), whatever the speed of this machine."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _router(rng: random.Random, prompts: list[list[int]], clock: _Clock) -> Router:
    router = Router("prefix_cost", seed=1, clock=clock)
    for i in range(REPLICAS):
        name = f"r{i}"
        router.add_replica(name)
        # Each replica's engine holds a few of the prefixes, as after a while of serving.
        blocks = [h for p in rng.sample(prompts, 8) for h in block_hashes(p, "m")]
        router.on_snapshot(name, {"seq": 0, "block_size": 16, "blocks": blocks, "load": {}})
    return router


def _pct(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"p50_us": round(s[len(s) // 2] * 1e6, 1), "p99_us": round(s[int(len(s) * 0.99)] * 1e6, 1)}


def bench_memory(n: int) -> dict:
    rng = random.Random(0)
    prompts = _prompts(rng, n)
    clock = _Clock()
    router = _router(rng, prompts, clock)
    samples = []
    for i, tokens in enumerate(prompts * 3):  # the first pass warms the index up
        clock.now += 0.001
        t = time.perf_counter()
        decision = router.route(tokens, "m")
        if i >= n:
            samples.append(time.perf_counter() - t)
        router.finish(decision.request_id)
    return _pct(samples) | {"mode": "memory"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _bench_redis(url: str, n: int) -> dict:
    rng = random.Random(0)
    prompts = _prompts(rng, n)
    clock = _Clock()
    shared = SharedRouter(_router(rng, prompts, clock), RedisStore(url, timeout_s=0.5), seed=1)
    samples = []
    for i, tokens in enumerate(prompts * 2):
        clock.now += 0.001
        t = time.perf_counter()
        decision = await shared.route(tokens, "m")
        if i >= n:
            samples.append(time.perf_counter() - t)
        await shared.finish(decision.request_id)
    state = shared.state.value
    await shared.store.close()
    return _pct(samples) | {"mode": "redis", "store_state": state}


def bench_redis(n: int) -> dict | None:
    binary = shutil.which("redis-server")
    if binary is None:
        print("redis-server not found: skipping the Redis measurement")
        return None
    port, workdir = _free_port(), tempfile.mkdtemp(prefix="kvgate-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.02)
        return asyncio.run(_bench_redis(f"redis://127.0.0.1:{port}/0", n))
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="routing decision latency")
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args(argv)
    summary = {"memory": bench_memory(args.requests)}
    print(json.dumps(summary["memory"]))
    result = bench_redis(args.requests)
    if result is not None:
        summary["redis"] = result
        print(json.dumps(result))
    results_file.write("routing_latency", summary, {"args": vars(args), "prompt_tokens": PROMPT_TOKENS,
                                                    "replicas": REPLICAS}, argv=argv)


if __name__ == "__main__":
    main()
