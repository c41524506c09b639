"""One engine decode step of a model (forward + logits, every row a decode row), timed with its
KV cache groups sharing pools (the hybrid KV cache manager, the default) and with a pool per
layer (`--disable-hybrid-kv-cache-manager`), each through the compiled decode step and layer by
layer (the path the step replaces).

    python -m benchmarks.decode_step --model gemma3-270m --rows 1,16

Every row decodes at the same context length, over blocks of its own in every KV cache group
(the pools hold zeros: what attention reads does not change its time). The engines are built as
`kvgate engine` builds them (the plan for this machine). Last line JSON: per manager, path and
row count, the best step time in ms."""

from __future__ import annotations

import argparse
import json

import torch

from backend_engine.llm import LLM
from backend_engine.step_batch import StepBatch
from benchmarks import results_file
from benchmarks.mixed_step import best_of

MANAGERS = {"groups": {}, "pool_per_layer": {"disable_hybrid_kv_cache_manager": True}}


def decode_batch(runner, rows: int, context: int) -> StepBatch:
    """`rows` decode rows at position context - 1, each over blocks of its own in each group."""
    per_seq = -(-context // runner.block_size)
    groups = max(1, len(runner.kv_cache_groups))
    if rows * per_seq * groups > runner.num_blocks:
        raise SystemExit(f"the KV cache holds {runner.num_blocks} blocks, the step needs "
                         f"{rows * per_seq * groups}: raise --kv-cache-gb")

    def blocks(seq: int, group: int) -> list[int]:
        start = (group * rows + seq) * per_seq
        return list(range(start, start + per_seq))

    return StepBatch(token_ids=[[1000 + i] for i in range(rows)],
                     num_computed_tokens=[context - 1] * rows, num_tokens=[context] * rows,
                     block_ids=[blocks(i, 0) for i in range(rows)],
                     num_prompt_tokens=[context - 1] * rows,
                     group_block_ids=[[blocks(i, g) for g in range(1, groups)]
                                      for i in range(rows)] if groups > 1 else [])


def best_ms(fn, repeats: int) -> float:
    return round(best_of(fn, repeats) * 1e3, 2)


def measure(llm: LLM, rows_list: list[int], context: int, repeats: int) -> dict:
    runner = llm.engine.runner
    forward = runner.forward_pass
    step = forward.decode_step
    out: dict = {"pools": len({id(k) for k, _ in runner.kv_caches}),
                 "layers": runner.model.num_layers, "plan": forward.describe()}
    for path, decode_step in (("compiled_step", step), ("layer_by_layer", None)):
        if path == "compiled_step" and step is None:
            continue
        forward.decode_step = decode_step
        for rows in rows_list:
            batch = decode_batch(runner, rows, context)
            with torch.inference_mode():
                out[f"{path}_{rows}_rows_ms"] = best_ms(lambda: runner.forward_batch(batch),
                                                        repeats)
    forward.decode_step = step
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--rows", default="1,16", help="decode rows per step, comma-separated")
    p.add_argument("--context", type=int, default=512, help="every row's context length")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-cache-gb", type=float, default=1.0,
                   help="KV cache memory of each engine (both managers hold the same layer-blocks)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = {}
    for name, flags in MANAGERS.items():
        llm = LLM(args.model, kv_cache_memory_gb=args.kv_cache_gb, **flags)
        results[name] = measure(llm, rows_list, args.context, args.repeats)
        print(name, json.dumps(results[name]), flush=True)
        del llm
    summary = {f"{name}_{key}": value for name, figures in results.items()
               for key, value in figures.items() if key.endswith("_ms")}
    summary.update(context=args.context, threads=torch.get_num_threads())
    print(json.dumps(summary))
    results_file.write("decode_step", summary, {"args": vars(args), "engines": results},
                       argv=argv, name=f"decode_step_{args.model}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
