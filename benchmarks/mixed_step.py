"""One engine step under real load: 64 running sequences at 500-2,000 tokens of context decoding,
plus a prefill chunk after a cached prefix, on the default model. Compares the whole step (model
forward + logits of the sampled rows) with the time of its matmuls alone at the same row counts,
and splits the rest into attention and everything else.

    python -m benchmarks.mixed_step                    # fp32, the machine's threads
    python -m benchmarks.mixed_step --dtype bfloat16 --threads 1

Attention is timed as the torch backend runs it layer by layer (eager); where the plan compiles,
the engine's decode rows take the compiled decode step instead. Last line JSON: step_ms,
matmul_ms, attention_ms, step_over_matmul (target <= 1.5)."""

from __future__ import annotations

import argparse
import json
import random
import time

from collections.abc import Callable

import torch

from backend_engine.attention.metadata import AttentionMetadata, PrefillChunk
from backend_engine.cli_args import key_value
from backend_engine.config import EngineConfig
from backend_engine.model_loader import resolve_model
from backend_engine.model_runner import ModelRunner
from benchmarks import results_file


def build_step(runner: ModelRunner, decodes: int, lo: int, hi: int, chunk: int, cached: int,
               seed: int = 0):
    """Token ids, positions and metadata; every sequence has its own (shuffled) blocks."""
    rng = random.Random(seed)
    bs = runner.block_size
    lens = [rng.randint(lo, hi) for _ in range(decodes)]
    need = [-(-n // bs) for n in lens] + [-(-(cached + chunk) // bs)]
    order = list(range(runner.num_blocks))
    rng.shuffle(order)
    if sum(need) > len(order):
        raise SystemExit(f"the KV cache holds {len(order)} blocks, the step needs {sum(need)}")
    tables, used = [], 0
    for n in need:
        tables.append(order[used:used + n])
        used += n
    width = max(len(t) for t in tables[:decodes])
    slots = [tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens)]
    slots += [tables[-1][p // bs] * bs + p % bs for p in range(cached, cached + chunk)]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), num_decode_tokens=decodes)
    meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables[:decodes]])
    meta.decode_context_lens = torch.tensor(lens)
    meta.prefills.append(PrefillChunk(decodes, chunk, cached + chunk, torch.tensor(tables[-1])))
    positions = torch.tensor([n - 1 for n in lens] + list(range(cached, cached + chunk)))
    ids = torch.randint(100, 30000, (decodes + chunk,), generator=torch.Generator().manual_seed(seed))
    return ids, positions, meta, sum(lens)


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mixed_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--decodes", type=int, default=64)
    p.add_argument("--context", default="500,2000", help="decode context lengths: LO,HI")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk tokens")
    p.add_argument("--cached", type=int, default=768, help="cached prefix before the chunk")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--engine-option", action="append", type=key_value, default=[],
                   metavar="KEY=VALUE", help="the engine's plan overrides, as `kvgate engine "
                   "--engine-option` (e.g. compiled=off)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lo, hi = (int(x) for x in args.context.split(","))
    config = EngineConfig(dtype=args.dtype, num_kv_blocks=args.decodes * (hi // 16 + 2) + 200,
                          engine_options=dict(args.engine_option))
    files = resolve_model(config.model)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(files.folder)
    runner = ModelRunner(config, files.folder, hf, 8192)
    model = runner.model
    ids, positions, meta, context = build_step(runner, args.decodes, lo, hi, args.chunk,
                                               args.cached)
    rows = args.decodes + args.chunk
    sampled = args.decodes + 1

    @torch.inference_mode()
    def step() -> None:
        meta.scratch.clear()
        hidden = runner.forward_pass(ids, positions, runner.kv_caches, meta)
        runner.forward_pass.compute_logits(hidden[-sampled:])

    x = torch.randn(rows, model.config.hidden_size, dtype=runner.dtype)
    inter = torch.randn(rows, model.layers[0].down_weight.shape[1], dtype=runner.dtype)
    attn_out = torch.randn(rows, model.num_heads * model.head_dim, dtype=runner.dtype)
    head_in = torch.randn(sampled, model.config.hidden_size, dtype=runner.dtype)

    @torch.inference_mode()
    def matmuls() -> None:
        linear = runner.forward_pass.linear
        for layer in model.layers:
            linear(x, layer.qkv_weight, layer.qkv_bias)
            linear(attn_out, layer.o_weight)
            linear(x, layer.gate_up_weight)
            linear(inter, layer.down_weight)
        linear(head_in, model.lm_head)

    q = torch.randn(rows, model.num_heads, model.head_dim, dtype=runner.dtype)
    k_cache, v_cache = runner.kv_caches[0]

    def attention_of(backend) -> Callable[[], None]:
        @torch.inference_mode()
        def attention() -> None:
            meta.scratch.clear()
            for _ in model.layers:
                backend.forward(q, k_cache, v_cache, meta, model.scale)
        return attention

    step_s = best_of(step, args.repeats)
    matmul_s = best_of(matmuls, args.repeats)
    attention_s = best_of(attention_of(model.attention), args.repeats)
    kv_bytes = 2 * context * model.num_kv_heads * model.head_dim * k_cache.element_size()
    result = {"step_ms": round(step_s * 1e3, 1), "matmul_ms": round(matmul_s * 1e3, 1),
              "attention_ms": round(attention_s * 1e3, 1),
              "decode_step": runner.forward_pass.decode_step is not None,
              "other_ms": round((step_s - matmul_s - attention_s) * 1e3, 1),
              "step_over_matmul": round(step_s / matmul_s, 3),
              "decode_kv_gb_per_s": round(kv_bytes * model.num_layers / attention_s / 1e9, 2),
              "rows": rows, "decode_context_tokens": context, "dtype": args.dtype,
              "threads": torch.get_num_threads()}
    print(f"step {result['step_ms']} ms = matmuls {result['matmul_ms']} + attention "
          f"{result['attention_ms']} + other {result['other_ms']}  ({rows} rows, "
          f"{args.decodes} decodes over {context} context tokens, a {args.chunk}-token chunk "
          f"after {args.cached})")
    print(json.dumps(result))
    results_file.write("mixed_step", result, {"args": vars(args)}, argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
