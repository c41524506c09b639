"""Decode attention over a paged KV pool, three ways, one layer at a time: the eager grouped
path, the compiled paged kernel (what the compiled decode step runs on CPU), and PyTorch's
FlexAttention with
a paged mask over the flat pool. SmolLM2-135M's heads (9 query, 3 KV, 64 wide), 64 rows at
500-2,000 tokens of context, blocks of 16 scattered over the pool as a busy replica's are.

    python -m benchmarks.decode_attention [--dtype bfloat16] [--rows 64]

Last line JSON: ms per layer for each, and each one's speed-up over eager."""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from backend_engine.accel.compile import Compiled
from backend_engine.accel.paged_decode import paged_decode
from backend_engine.attention.metadata import AttentionMetadata
from backend_engine.attention.torch_backend import TorchAttention
from benchmarks import results_file
from benchmarks.mixed_step import best_of

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SCALE = HEAD_DIM ** -0.5


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    return best_of(fn, repeats) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", default="500,2000", help="LO,HI tokens")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (slow)")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    lo, hi = (int(x) for x in args.context.split(","))
    rng = random.Random(0)
    lens = [rng.randint(lo, hi) for _ in range(args.rows)]
    num_blocks = sum(-(-n // BLOCK) for n in lens) + 8
    order = list(range(num_blocks))
    rng.shuffle(order)
    owner = torch.full((num_blocks,), -1, dtype=torch.long)
    logical = torch.zeros(num_blocks, dtype=torch.long)
    tables, used = [], 0
    for row, n in enumerate(lens):
        table = order[used:used + -(-n // BLOCK)]
        used += len(table)
        tables.append(table)
        owner[table] = row
        logical[table] = torch.arange(len(table))
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    context_lens = torch.tensor(lens)
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    query = torch.randn(args.rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.zeros(args.rows, dtype=torch.long),
                             num_decode_tokens=args.rows)
    meta.decode_block_tables, meta.decode_context_lens = block_tables, context_lens

    eager = TorchAttention()

    def run_eager() -> torch.Tensor:
        meta.scratch.clear()
        return eager.forward(query, k_cache, v_cache, meta, SCALE)

    compiled = Compiled(paged_decode, "paged decode attention")

    def run_compiled() -> torch.Tensor:
        out = compiled(query, k_cache, v_cache, block_tables, context_lens, SCALE)
        if compiled.failed:
            raise SystemExit("torch.compile failed here (a C++ compiler is needed)")
        return out

    reference = run_eager().float()
    result = {"rows": args.rows, "context_tokens": sum(lens), "dtype": args.dtype,
              "threads": torch.get_num_threads(),
              "eager_ms": round(best_ms(run_eager, args.repeats), 1),
              "compiled_ms": round(best_ms(run_compiled, args.repeats), 1),
              "compiled_max_err": float((run_compiled().float() - reference).abs().max())}
    if not args.no_flex:
        def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001 - FlexAttention's signature
            block = kv_idx // BLOCK
            return (owner[block] == q_idx) & (logical[block] * BLOCK + kv_idx % BLOCK
                                              < context_lens[q_idx])

        flat = num_blocks * BLOCK
        start = time.perf_counter()
        mask = create_block_mask(mask_mod, 1, None, args.rows, flat, device="cpu")
        result["flex_mask_ms"] = round((time.perf_counter() - start) * 1e3, 1)
        k = k_cache.view(1, flat, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = v_cache.view(1, flat, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q = query.view(1, args.rows, HEADS, HEAD_DIM).transpose(1, 2)
        flex = torch.compile(flex_attention, dynamic=False)

        def run_flex() -> torch.Tensor:
            out = flex(q, k, v, block_mask=mask, scale=SCALE, enable_gqa=True)
            return out.transpose(1, 2).reshape(args.rows, HEADS, HEAD_DIM)

        result["flex_ms"] = round(best_ms(run_flex, args.repeats), 1)
        result["flex_max_err"] = float((run_flex().float() - reference).abs().max())
        result["flex_speedup"] = round(result["eager_ms"] / result["flex_ms"], 2)
    result["compiled_speedup"] = round(result["eager_ms"] / result["compiled_ms"], 2)
    print(f"{args.rows} decode rows over {sum(lens)} tokens ({args.dtype}), ms per layer: eager "
          f"{result['eager_ms']}, compiled {result['compiled_ms']}"
          + (f", FlexAttention {result['flex_ms']} (+{result['flex_mask_ms']} ms to build its "
             "mask)" if "flex_ms" in result else ""))
    print(json.dumps(result))
    results_file.write("decode_attention", result, {"args": vars(args)}, argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
