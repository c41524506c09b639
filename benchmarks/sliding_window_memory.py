"""KV memory of a sliding-window model with and without KV cache groups (vLLM's hybrid
allocator, backend_engine/kv_cache_groups.py): Gemma 3 270M (18 layers, 15 with a 512-token
window, 3 global), bytes a sequence holds at 2k/8k/32k tokens and the most such sequences a
fixed KV budget holds.

The figures come from the engine's own pieces, not a formula: the pool is sized by kv_sizing.py
from the budget and the page a block spans, and sequences go through the KV cache manager the
engine uses (hybrid: sliding groups give back blocks that left the window; masked: one group,
every layer keeps every block, --disable-hybrid-kv-cache-manager), prompt chunks of
--max-num-batched-tokens, then one decode step. `--engine` also starts the real replica both
ways and checks that its KV tensors take the bytes the figures assume. No timing: the figures
are the same on any machine.

    python -m benchmarks.sliding_window_memory [--model gemma3-270m] [--kv-cache-memory 1]
"""

from __future__ import annotations

import argparse
import json

from transformers import AutoConfig

from backend_engine.block_pool import BlockPool
from backend_engine.hybrid_kv_cache_manager import HybridKVCacheManager
from backend_engine.kv_cache_groups import KVCacheGroupSpec, kv_cache_groups, page_layers
from backend_engine.kv_cache_manager import KVCacheManager
from backend_engine.kv_sizing import kv_block_bytes, kv_pool_size
from backend_engine.model_loader import resolve_model
from backend_engine.sampling_params import SamplingParams
from backend_engine.sequence import Sequence
from benchmarks import results_file

LENGTHS = (2048, 8192, 32768)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MIB = 1 << 20


def layer_windows(config) -> list[int]:
    """Gemma 3's rule (backend_engine/models/gemma3.py): `layer_types` names the sliding ones."""
    return [config.sliding_window if kind == "sliding_attention" else 0
            for kind in config.layer_types]


def build(groups: list[KVCacheGroupSpec], config, args) -> tuple[KVCacheManager, int]:
    """The manager over a pool sized from the budget as the runner sizes it; its block bytes."""
    block_bytes = kv_block_bytes(page_layers(groups), args.block_size, config.num_key_value_heads,
                                 config.head_dim, DTYPE_BYTES[args.dtype])
    size = kv_pool_size(block_bytes, kv_cache_memory_gb=args.kv_cache_memory)
    pool = BlockPool(size.num_blocks, enable_caching=False)
    if len(groups) == 1:
        return KVCacheManager(pool, args.block_size), block_bytes
    return HybridKVCacheManager(pool, args.block_size, groups,
                                args.max_num_batched_tokens), block_bytes


def run_sequence(kv: KVCacheManager, seq_id: int, num_tokens: int, chunk: int
                 ) -> tuple[Sequence | None, int]:
    """A prompt of num_tokens - 1 tokens in chunks, then the decode of the sampled token, as the
    engine steps them; the peak blocks the pool lent meanwhile (None: the pool ran out, and
    what the sequence held is given back)."""
    seq = Sequence(str(seq_id), str(seq_id), 0, [seq_id] * (num_tokens - 1), SamplingParams(),
                   "bench", 1)
    pool, peak = kv.pool, 0
    while seq.num_computed_tokens < num_tokens:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(0)  # the token the prompt's last step sampled
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        if not kv.allocate_slots(seq, n):
            kv.free(seq)
            return None, peak
        peak = max(peak, pool.num_blocks - pool.num_free_blocks)
        seq.num_computed_tokens += n
    return seq, peak


def measure(groups: list[KVCacheGroupSpec], config, args) -> dict:
    out = {}
    for length in LENGTHS:
        kv, block_bytes = build(groups, config, args)
        seq, peak = run_sequence(kv, 0, length, args.max_num_batched_tokens)
        held = None if seq is None else kv.pool.num_blocks - kv.pool.num_free_blocks
        fits = 0
        while seq is not None:  # more sequences beside the decoding ones until one cannot fit
            fits += 1
            seq, _ = run_sequence(kv, fits, length, args.max_num_batched_tokens)
        out[length] = {"held_mib": None if held is None else round(held * block_bytes / MIB, 2),
                       "peak_mib": round(peak * block_bytes / MIB, 2), "max_seqs": fits,
                       "num_blocks": kv.pool.num_blocks, "block_bytes": block_bytes}
    return out


def engine_check(model: str, args) -> dict:
    """The real replica's KV tensors, with and without groups (bytes and blocks), and its
    greedy answer to a prompt of three windows, the same both ways."""
    from backend_engine.llm import LLM

    out, answers = {}, []
    prompt = [1000 + (i * 7919) % 20000 for i in range(3 * 512)]
    for name, disable in (("hybrid", False), ("masked", True)):
        llm = LLM(model, kv_cache_memory_gb=args.kv_cache_memory, dtype=args.dtype,
                  block_size=args.block_size, enforce_eager=True, target_itl_ms=0,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  disable_hybrid_kv_cache_manager=disable)
        runner = llm.engine.runner
        tensors = {id(t): t for pair in runner.kv_caches for t in pair}.values()
        out[name] = {"groups": len(runner.kv_cache_groups), "num_blocks": runner.num_blocks,
                     "kv_bytes": sum(t.numel() * t.element_size() for t in tensors)}
        answer = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0]
        answers.append(answer.outputs[0].token_ids)
        llm.engine.close()
    out["same_answer"] = answers[0] == answers[1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--kv-cache-memory", type=float, default=1.0, help="KV budget, GiB")
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPE_BYTES))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512,
                    help="prompt chunk (the engine's CPU default; 8192 on CUDA)")
    ap.add_argument("--engine", action="store_true", help="also start the replica both ways")
    args = ap.parse_args()
    config = AutoConfig.from_pretrained(resolve_model(args.model).folder)
    hybrid_groups = kv_cache_groups(layer_windows(config))
    layers = tuple(range(config.num_hidden_layers))
    table = {"hybrid": measure(hybrid_groups, config, args),
             "masked": measure([KVCacheGroupSpec(layers)], config, args)}
    print(f"{args.model}: {config.num_hidden_layers} layers in {len(hybrid_groups)} groups of "
          f"{page_layers(hybrid_groups)}, window {config.sliding_window}; "
          f"{args.kv_cache_memory:g} GiB of {args.dtype} KV, chunks of "
          f"{args.max_num_batched_tokens}")
    print(f"{'tokens':>7} {'MiB held: masked':>17} {'hybrid':>8} {'x':>6} "
          f"{'max seqs: masked':>17} {'hybrid':>7}")
    summary: dict[str, float] = {}
    for length in LENGTHS:
        m, h = table["masked"][length], table["hybrid"][length]
        ratio = round(m["held_mib"] / h["held_mib"], 2) if m["held_mib"] and h["held_mib"] else None
        print(f"{length:>7} {m['held_mib']!s:>17} {h['held_mib']!s:>8} {ratio!s:>6} "
              f"{m['max_seqs']:>17} {h['max_seqs']:>7}")
        k = length // 1024
        summary.update({f"masked_{k}k_mib": m["held_mib"], f"hybrid_{k}k_mib": h["held_mib"],
                        f"saved_{k}k_x": ratio, f"masked_{k}k_max_seqs": m["max_seqs"],
                        f"hybrid_{k}k_max_seqs": h["max_seqs"]})
    results = {"args": vars(args), "groups": len(hybrid_groups), "per_length": table}
    if args.engine:
        results["engine"] = engine_check(args.model, args)
        print("engine:", json.dumps(results["engine"]))
        for name in ("hybrid", "masked"):
            blocks = table[name][LENGTHS[0]]
            if results["engine"][name]["num_blocks"] != blocks["num_blocks"] or \
                    results["engine"][name]["kv_bytes"] != blocks["num_blocks"] * blocks["block_bytes"]:
                raise SystemExit(f"the replica's {name} KV cache differs from the figures'")
        if not results["engine"]["same_answer"]:
            raise SystemExit("the replica answers differently with KV cache groups")
        summary["engine_checked"] = 1
    print(json.dumps(summary))
    results_file.write("sliding_window_memory", summary, results)


if __name__ == "__main__":
    main()
