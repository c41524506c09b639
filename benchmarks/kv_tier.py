"""KV tier: multi-turn chat sessions whose working set is 4x the KV pool, served by the same
engine without a tier, with a host-memory tier and with a disk tier, in one run, beside a pool the
working set fits in (the bound, and the reference a restore must give the answers of).

Sessions are built like the Mooncake conversation trace: a system prompt every session shares,
a first message per session, then turns that resend the whole conversation (the engine's own
answer included) plus a new message. Requests go one at a time, sessions in turn, so between
two turns of a session every other session passes through the pool and, in a pool a quarter
of the working set, evicts it. Without a tier each turn prefills its whole conversation again;
with one, the evicted prefix is restored.

Prints TTFT p50/p99, prefill tokens, restore and prefill time per token per run; the last line
is JSON with `restore_vs_prefill_speed` (prefill time per token / restore time per token, RAM
tier) and `ttft_p50_ratio` (RAM tier / no tier), and writes benchmarks/results/kv_tier.json.

    python -m benchmarks.kv_tier [--sessions 8 --turns 5 --model default]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import dataclass, field

from benchmarks import results_file


@dataclass
class Turn:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    answer: list[int]


@dataclass
class Run:
    label: str
    turns: list[Turn] = field(default_factory=list)
    tier: dict = field(default_factory=dict)

    def ttft(self, q: float) -> float:
        values = sorted(t.ttft_s for t in self.turns)
        return values[min(len(values) - 1, int(q * len(values)))]

    @property
    def prefill_tokens(self) -> int:
        return sum(t.prompt_tokens - t.cached_tokens for t in self.turns)

    def prefill_s_per_token(self) -> float:
        return sum(t.ttft_s for t in self.turns) / max(1, self.prefill_tokens)


def messages(args: argparse.Namespace, seed: int) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt, and each session's user messages (token ids)."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]  # noqa: E731
    system = draw(args.system_tokens)
    sessions = [[draw(args.first_tokens)] + [draw(args.turn_tokens) for _ in range(args.turns - 1)]
                for _ in range(args.sessions)]
    return system, sessions


def final_prompt_tokens(args: argparse.Namespace) -> int:
    return (args.system_tokens + args.first_tokens
            + (args.turns - 1) * (args.turn_tokens + args.max_tokens))


def working_set_blocks(args: argparse.Namespace) -> int:
    return args.sessions * -(-final_prompt_tokens(args) // 16)


def open_engine(args: argparse.Namespace, pool_blocks: int, **tier):
    from backend_engine.config import EngineConfig
    from backend_engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=args.model, num_kv_blocks=pool_blocks, target_itl_ms=0,
                                  max_num_batched_tokens=2048, enforce_eager=args.enforce_eager,
                                  **tier))


def one_turn(engine, rid: str, prompt: list[int], max_tokens: int) -> Turn:  # noqa: ANN001
    from backend_engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    first = None
    while True:
        outs = [o for o in engine.step() if o.request_id == rid]
        if outs and first is None and outs[-1].outputs[0].token_ids:
            first = time.perf_counter() - start
        if outs and outs[-1].finished:
            break
    out = outs[-1]
    return Turn(first, len(prompt), out.num_cached_tokens, list(out.outputs[0].token_ids))


def serve(engines: dict, args: argparse.Namespace, seed: int) -> dict[str, Run]:
    """The sessions on every engine, request by request in turn (a slow moment of this shared
    machine hits every engine alike)."""
    system, sessions = messages(args, seed)
    runs = {label: Run(label) for label in engines}
    history = {label: [list(system) for _ in sessions] for label in engines}
    for t in range(args.turns):
        for s, session in enumerate(sessions):
            for label, engine in engines.items():
                prompt = history[label][s] + session[t]
                turn = one_turn(engine, f"{seed}-{s}-{t}", prompt, args.max_tokens)
                runs[label].turns.append(turn)
                history[label][s] = prompt + turn.answer
    for label, engine in engines.items():
        runs[label].tier = engine.load().get("kv_tier", {})
    return runs


def report(runs: list[Run]) -> None:
    print(f"{'run':<10} {'TTFT p50':>9} {'TTFT p99':>9} {'prefill tok':>11} {'restored tok':>12} "
          f"{'restore us/tok':>14} {'prefill us/tok':>14}")
    for r in runs:
        hits = r.tier.get("hit_tokens", 0)
        seconds = r.tier.get("restore_seconds_total", 0.0) + r.tier.get("read_seconds_total", 0.0)
        restore = seconds / hits * 1e6 if hits else float("nan")  # disk: the reads included
        print(f"{r.label:<10} {r.ttft(0.5) * 1000:>7.1f}ms {r.ttft(0.99) * 1000:>7.1f}ms "
              f"{r.prefill_tokens:>11} {hits:>12} {restore:>14.2f} "
              f"{r.prefill_s_per_token() * 1e6:>14.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=64)
    ap.add_argument("--first-tokens", type=int, default=320)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--working-set-ratio", type=float, default=4.0,
                    help="working set of the sessions over the pool")
    ap.add_argument("--no-disk", action="store_true", help="skip the disk-tier run")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no compiled graphs (a quick start where they are not cached yet; "
                         "prefill is slower, so the tier gains more)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    working_set = working_set_blocks(args)
    largest = -(-(final_prompt_tokens(args) + args.max_tokens) // 16)  # one request must fit
    pool_blocks = max(largest + 4, int(working_set / args.working_set_ratio))
    with tempfile.TemporaryDirectory(prefix="kv-tier-bench-") as folder:
        engines = {"no tier": open_engine(args, pool_blocks),
                   "RAM tier": open_engine(args, pool_blocks, kv_offload_size_gb=8.0)}
        if not args.no_disk:
            engines["disk tier"] = open_engine(args, pool_blocks, kv_offload_dir=folder,
                                               kv_offload_disk_size_gb=8.0)
        # the bound, and the tier's exactness reference: a pool the working set fits in
        engines["big pool"] = open_engine(args, working_set + 2 * largest)
        try:
            if not args.enforce_eager:  # compiled graphs for every shape, outside the figures:
                serve(engines, args, args.seed + 1)  # other sessions with the same lengths
            for engine in engines.values():
                if not engine.pool.reset_prefix_cache():
                    raise RuntimeError("the warm-up left blocks in use")
                engine.pool.flush_events()
                if engine.pool.tier is not None:
                    engine.pool.tier.stats = type(engine.pool.tier.stats)()
            runs = list(serve(engines, args, args.seed).values())
        finally:
            for engine in engines.values():
                engine.close()
    print(f"{args.sessions} sessions x {args.turns} turns, working set {working_set} blocks, "
          f"pool {pool_blocks} blocks ({working_set / pool_blocks:.1f}x)")
    report(runs)
    base, ram, big = runs[0], runs[1], runs[-1]
    restore_per_token = ram.tier["restore_seconds_total"] / max(1, ram.tier["hit_tokens"])
    same = sum(a.answer == b.answer for a, b in zip(base.turns, ram.turns))
    exact = sum(a.answer == b.answer for a, b in zip(big.turns, ram.turns))
    summary = {
        "restore_vs_prefill_speed": round(base.prefill_s_per_token() / restore_per_token, 1),
        "ttft_p50_ratio": round(ram.ttft(0.5) / base.ttft(0.5), 3),
        "ttft_p99_ratio": round(ram.ttft(0.99) / base.ttft(0.99), 3),
        "prefill_tokens_saved": base.prefill_tokens - ram.prefill_tokens,
        "prefill_tokens_saved_share": round(1 - ram.prefill_tokens / base.prefill_tokens, 3),
        # a restored prefix holds the bytes a pool hit would: the same answers as the big pool;
        # a recompute prefills earlier answers in one pass where decode computed them one by
        # one, so fp32 rounding may differ from the cached runs after the first turn
        "answers_identical_to_pool_hits": f"{exact}/{len(big.turns)}",
        "answers_identical_to_recompute": f"{same}/{len(base.turns)}",
        "ttft_p50_ratio_big_pool": round(big.ttft(0.5) / base.ttft(0.5), 3),
    }
    if not args.no_disk:
        summary["ttft_p50_ratio_disk"] = round(runs[2].ttft(0.5) / base.ttft(0.5), 3)
    table = {r.label: {"ttft_p50_s": round(r.ttft(0.5), 4), "ttft_p99_s": round(r.ttft(0.99), 4),
                       "prefill_tokens": r.prefill_tokens,
                       "prefill_s_per_token": r.prefill_s_per_token(), "tier": r.tier}
             for r in runs}
    results_file.write("kv_tier", summary, {"args": vars(args), "working_set_blocks": working_set,
                                            "pool_blocks": pool_blocks, "runs": table})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
