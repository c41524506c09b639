"""One mixture-of-experts layer's experts (backend_engine/models/moe.py), tokens per second of
three ways to run a step's rows through them:

- `grouped`: the engine's path (`moe.grouped_experts`): the (row, expert) pairs sorted by expert,
  each chosen expert run once over all its rows, the weighted results scatter-added;
- `per_token`: each row runs its k experts one at a time (k one-row matmul chains per row);
- `dense`: every expert runs over every row, weighted by the router (zeros for the experts a row
  did not choose) — what a MoE without routing-aware code costs.

The last two are baselines here only. Random weights of realistic shape ratios (the work does
not depend on the values), routed by the engine's softmax top-k router over random rows; the
three outputs are checked equal before timing. Steps of 1 row (c=1 decode), 16 rows (c=16
decode) and 256 rows (a prompt chunk); the fastest of repeated calls. fp32 through the reference
Linear (F.linear), the engine's CPU default. Ends with one line of JSON: each shape's tok/s per
path and row count, and the grouped path's speed-up over each baseline."""

from __future__ import annotations

import argparse
import json
import time

import torch

from backend_engine.models.layers import silu_mlp
from backend_engine.models.linear import REFERENCE
from backend_engine.models.moe import Experts, Router, grouped_experts
from benchmarks import results_file

# name: (hidden, experts, top k, expert width)
SHAPES = {
    # Mixtral 8x7B scaled down: 8 experts, top 2, each 3.5x hidden wide (14336 / 4096)
    "mixtral_like": (1024, 8, 2, 3584),
    # Qwen3-30B-A3B scaled down: fine-grained experts 0.375x hidden wide (768 / 2048), 1 in 8
    # active (its 8 of 128 here 2 of 16)
    "qwen3_moe_like": (1024, 16, 2, 384),
}
ROWS = (1, 16, 256)


def per_token(x: torch.Tensor, top_weights: torch.Tensor, top_experts: torch.Tensor,
              experts: Experts) -> torch.Tensor:
    """Each row alone, its k experts one after another."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        row = x[t:t + 1]
        for weight, e in zip(top_weights[t].tolist(), top_experts[t].tolist()):
            out[t] += weight * silu_mlp(row, *experts[e], REFERENCE)[0]
    return out


def dense(x: torch.Tensor, top_weights: torch.Tensor, top_experts: torch.Tensor,
          experts: Experts) -> torch.Tensor:
    """Every expert over every row, times the row's router weight for it (0 if unchosen)."""
    gates = torch.zeros(x.shape[0], len(experts), dtype=top_weights.dtype)
    gates.scatter_(1, top_experts, top_weights)
    out = torch.zeros_like(x)
    for e, (gate_up, down) in enumerate(experts):
        out += silu_mlp(x, gate_up, down, REFERENCE) * gates[:, e:e + 1]
    return out


def _best_s(fn, budget_s: float, max_repeats: int = 500) -> float:
    """The fastest call after a warm-up, repeated until `budget_s` is spent (at least 3)."""
    fn()
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 3 or (spent < budget_s and calls < max_repeats):
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent, calls = min(best, took), spent + took, calls + 1
    return best


def layer(hidden: int, num_experts: int, width: int) -> tuple[torch.Tensor, Experts]:
    """A router weight [E, H] and E experts' (gate/up [2W, H], down [H, W]) weights."""
    experts = [(torch.randn(2 * width, hidden) * hidden ** -0.5,
                torch.randn(hidden, width) * width ** -0.5) for _ in range(num_experts)]
    return torch.randn(num_experts, hidden) * hidden ** -0.5, experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=1.5,
                    help="seconds of repeated calls per measurement (at least 3 calls)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    paths = {"grouped": lambda x, w, e, ex: grouped_experts(x, w, e, ex, REFERENCE),
             "per_token": per_token, "dense": dense}
    table: dict[str, dict[str, dict[int, float]]] = {}
    summary: dict[str, float] = {}
    with torch.inference_mode():
        for name, (hidden, num_experts, k, width) in SHAPES.items():
            router_weight, experts = layer(hidden, num_experts, width)
            router = Router(k, renormalise=True, round_weights=False)
            table[name] = {path: {} for path in paths}
            for rows in ROWS:
                x = torch.randn(rows, hidden)
                top_weights, top_experts = router(x, router_weight)
                outputs = [fn(x, top_weights, top_experts, experts) for fn in paths.values()]
                for out in outputs[1:]:
                    torch.testing.assert_close(out, outputs[0], rtol=1e-4, atol=1e-4)
                for path, fn in paths.items():
                    seconds = _best_s(lambda: fn(x, top_weights, top_experts, experts),
                                      args.budget_s)
                    table[name][path][rows] = round(rows / seconds, 1)
                    summary[f"{name}_{path}_rows{rows}_tok_s"] = table[name][path][rows]
                for base in ("per_token", "dense"):
                    summary[f"{name}_grouped_vs_{base}_rows{rows}"] = round(
                        table[name]["grouped"][rows] / table[name][base][rows], 2)
            print(f"{name}: hidden {hidden}, {num_experts} experts, top {k}, width {width}; "
                  f"tok/s ({args.threads} threads)")
            print(f"{'rows':>6} " + " ".join(f"{path:>12}" for path in paths))
            for rows in ROWS:
                print(f"{rows:>6} " + " ".join(f"{table[name][p][rows]:>12.1f}" for p in paths))
    print(json.dumps(summary))
    results_file.write("moe_experts", summary,
                       {"args": vars(args), "shapes": {n: dict(zip(
                           ("hidden", "experts", "top_k", "expert_width"), s))
                           for n, s in SHAPES.items()}, "tok_s": table})


if __name__ == "__main__":
    main()
