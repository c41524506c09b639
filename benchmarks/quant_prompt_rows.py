"""Prompt rows of quantised CPU weights: one SmolLM2 layer's four matmuls (qkv, o, gate_up,
down), summed, at several row counts, through every form the plan (backend_engine/accel/plan.py)
may give them — `kernel` (torch's weight-only kernels), `tiles` (dequantise to bf16, then GEMMs
over 64-row tiles), `int8_sums` (int8 weights, int4 ones requantised per call, times the
activations as two int8 digits), int4's `template` (Inductor's GEMM template, where it builds) —
with bf16's and fp32's F.linear beside them. Random weights of the real shapes (the work does
not depend on the values); the best of several passes, interleaved. The measurements behind the
plan's prompt column; ends with one line of JSON: each prompt form's speed-up over the kernel
per format and row count."""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from backend_engine.accel.cpu import int8_sums, template, tiles
from backend_engine.accel.cpu import kernels as cpu
from backend_engine.quant.formats import quantize_int4, quantize_int8
from benchmarks import results_file

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2-135M: qkv, o, gate_up, down
ROWS = (1, 16, 64, 256, 512)


def _best_us(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    fp = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    weights = {"fp32": fp, "bf16": [w.to(torch.bfloat16) for w in fp],
               "int8": [cpu.prepare_int8(quantize_int8(w)) for w in fp],
               "int4": [cpu.prepare_int4(quantize_int4(w, 32, "w")) for w in fp]}
    forms = {"fp32 F.linear": ("fp32", F.linear), "bf16 F.linear": ("bf16", F.linear),
             "int8 kernel": ("int8", cpu.int8_mm),
             "int8 tiles": ("int8", tiles.int8_tiles),
             "int8 int8_sums": ("int8", int8_sums.int8_weight_sums),
             "int4 kernel": ("int4", cpu.int4_mm)}
    if tiles.int4_layout_checked():
        forms["int4 tiles"] = ("int4", tiles.int4_tiles)
        forms["int4 int8_sums"] = ("int4", int8_sums.int4_weight_sums)
    templates = {id(w): template.compile_for(w) for w in weights["int4"]}
    if all(templates.values()):  # None where Inductor cannot build it here
        forms["int4 template"] = ("int4", lambda x, w: templates[id(w)](x))
    table: dict[str, dict[int, float]] = {name: {} for name in forms}
    with torch.inference_mode():
        for rows in ROWS:
            xs = [torch.randn(rows, k, dtype=torch.bfloat16) for _, k in SHAPES]
            for name, (kind, form) in forms.items():
                layer = weights[kind]
                xs = [x.to(torch.float32 if kind == "fp32" else torch.bfloat16) for x in xs]
                table[name][rows] = _best_us(
                    lambda: [form(x, w) for x, w in zip(xs, layer)], args.repeats)
    print(f"one layer's four matmuls, µs ({args.threads} threads)")
    print(f"{'rows':>6} " + " ".join(f"{name:>18}" for name in forms))
    for rows in ROWS:
        print(f"{rows:>6} " + " ".join(f"{table[name][rows]:>18.0f}" for name in forms))
    suffix = {"tiles": "tiles", "template": "template", "int8_sums": "int8_sums"}
    speedup = {f"{name.split()[0]}_{suffix[name.split()[1]]}_rows{rows}_vs_kernel":
               round(table[f"{name.split()[0]} kernel"][rows] / table[name][rows], 2)
               for name in forms if name.split()[1] in suffix for rows in ROWS}
    print(json.dumps(speedup))
    results_file.write("quant_prompt_rows", speedup, {"args": vars(args), "us_per_layer": table})


if __name__ == "__main__":
    main()
