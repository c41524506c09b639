"""Request priority: interactive requests mixed with a batch flood, FCFS against priority.

The real engine (AsyncLLMEngine, default model, CPU) runs the same arrival schedule twice, once
with scheduling_policy="fcfs" and once with "priority":
- batch: `--batch-streams` closed-loop clients, each sending a long-output request (priority
  `--batch-priority`) as soon as its previous one finishes, so the running batch stays full and a
  queue builds behind it;
- interactive: `--interactive` short requests (priority `--interactive-priority`), one every
  `--interval` seconds, after a warm-up that lets the flood fill the engine.
Prints a table (TTFT p50/p99 per class, batch throughput) and ends with one line of JSON:
{"interactive_ttft_p99_ratio": priority / fcfs, "batch_throughput_ratio": priority / fcfs, …}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

from backend_engine.async_engine import AsyncLLMEngine
from backend_engine.config import EngineConfig
from backend_engine.sampling_params import SamplingParams
from benchmarks import results_file
from benchmarks.workloads import token_prompts


@dataclass(slots=True)
class RunResult:
    policy: str
    interactive_ttft_s: list[float] = field(default_factory=list)
    batch_ttft_s: list[float] = field(default_factory=list)
    batch_tokens: int = 0  # generated inside the measured window
    window_s: float = 0.0
    preemptions: int = 0

    @property
    def batch_tok_s(self) -> float:
        return self.batch_tokens / self.window_s if self.window_s else 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run(policy: str, args: argparse.Namespace) -> RunResult:
    engine = AsyncLLMEngine(EngineConfig(
        model=args.model, max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens, scheduling_policy=policy,
        num_threads=args.num_threads, enforce_eager=args.enforce_eager))
    await engine.start()
    tokenizer = engine.tokenizer
    batch_prompts = token_prompts(tokenizer, args.batch_streams * 8, args.batch_prompt_tokens, seed=1)
    chat_prompts = token_prompts(tokenizer, args.interactive, args.interactive_prompt_tokens, seed=2)
    result = RunResult(policy)
    batch_params = SamplingParams(temperature=0, max_tokens=args.batch_output_tokens, ignore_eos=True)
    chat_params = SamplingParams(temperature=0, max_tokens=args.interactive_output_tokens,
                                 ignore_eos=True)
    async for _ in engine.generate(chat_prompts[0], SamplingParams(max_tokens=2), "warm-up"):
        pass
    window: list[float] = []  # [start, end] once known
    stop = asyncio.Event()

    async def one(prompt, params, rid, priority, ttfts) -> None:
        sent = time.perf_counter()
        seen = 0
        async for out in engine.generate(prompt, params, rid, priority=priority):
            now = time.perf_counter()
            produced = len(out.outputs[0].token_ids)
            if seen == 0 and produced:
                ttfts.append(now - sent)
            if rid.startswith("batch") and len(window) == 1:
                result.batch_tokens += produced - seen
            seen = produced

    async def batch_stream(s: int) -> None:
        k = 0
        while not stop.is_set():
            prompt = batch_prompts[(s * 8 + k) % len(batch_prompts)]
            await one(prompt, batch_params, f"batch-{s}-{k}", args.batch_priority, result.batch_ttft_s)
            k += 1

    async def interactive(i: int) -> None:
        await asyncio.sleep(args.warmup + i * args.interval)
        await one(chat_prompts[i], chat_params, f"chat-{i}", args.interactive_priority,
                  result.interactive_ttft_s)

    preempted_before = engine.stats.preemptions
    streams = [asyncio.ensure_future(batch_stream(s)) for s in range(args.batch_streams)]
    await asyncio.sleep(args.warmup)
    window.append(time.perf_counter())
    result.batch_ttft_s.clear()
    await asyncio.gather(*(interactive(i) for i in range(args.interactive)))
    window.append(time.perf_counter())
    result.window_s = window[1] - window[0]
    result.preemptions = engine.stats.preemptions - preempted_before
    stop.set()
    for task in streams:
        task.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    await engine.shutdown()
    return result


def row(r: RunResult) -> str:
    ms = 1000
    return (f"{r.policy:9s} {percentile(r.interactive_ttft_s, .5) * ms:9.0f} "
            f"{percentile(r.interactive_ttft_s, .99) * ms:9.0f} "
            f"{percentile(r.batch_ttft_s, .5) * ms:9.0f} {percentile(r.batch_ttft_s, .99) * ms:9.0f} "
            f"{r.batch_tok_s:10.1f} {r.preemptions:8d}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=256)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="nothing compiled (as vLLM's flag): a shorter start-up")
    ap.add_argument("--batch-streams", type=int, default=12)
    ap.add_argument("--batch-prompt-tokens", type=int, default=96)
    ap.add_argument("--batch-output-tokens", type=int, default=96)
    ap.add_argument("--batch-priority", type=int, default=10)
    ap.add_argument("--interactive", type=int, default=20)
    ap.add_argument("--interactive-prompt-tokens", type=int, default=32)
    ap.add_argument("--interactive-output-tokens", type=int, default=8)
    ap.add_argument("--interactive-priority", type=int, default=0)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between interactive requests")
    ap.add_argument("--warmup", type=float, default=4.0, help="seconds of flood before measuring")
    return ap


def main() -> None:
    args = parser().parse_args()

    results = [asyncio.run(run(policy, args)) for policy in ("fcfs", "priority")]
    print(f"{'policy':9s} {'chat p50':>9s} {'chat p99':>9s} {'batch p50':>9s} {'batch p99':>9s} "
          f"{'batch tok/s':>10s} {'preempt':>8s}   (TTFT in ms)")
    for r in results:
        print(row(r))
    fcfs, prio = results
    summary = {
        "interactive_ttft_p99_ratio": round(percentile(prio.interactive_ttft_s, .99)
                                            / percentile(fcfs.interactive_ttft_s, .99), 3),
        "batch_throughput_ratio": round(prio.batch_tok_s / fcfs.batch_tok_s, 3),
        "interactive_ttft_p99_ms": {r.policy: round(percentile(r.interactive_ttft_s, .99) * 1000, 1)
                                    for r in results},
        "batch_tok_s": {r.policy: round(r.batch_tok_s, 1) for r in results},
        "preemptions": {r.policy: r.preemptions for r in results},
    }
    print(json.dumps(summary))
    results_file.write("priority", summary, {"args": vars(args)})


if __name__ == "__main__":
    main()
