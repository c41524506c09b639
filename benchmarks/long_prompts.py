"""Prefill and decode speed of the offline engine on long prompts, per plan variant, in one run.

The default model as the plan of this machine's class serves it (backend_engine/accel/plan.py),
once per variant (`--variant "KEY=VALUE,..."`, engine options; "" is the plan as it stands),
each variant in turn in the same process:
- prefill tok/s: `--prompts` distinct random-text prompts of `--min-tokens` to `--max-tokens`
  tokens (evenly spread), all given at once with max_tokens=1: prompt tokens / wall time;
- decode tok/s: the same prompts again (their prefixes now cached), `--new-tokens` output tokens
  each (ignore_eos): output tokens / wall time, so decode rows over long contexts, all at once.
Each variant warms up first (its compiled graphs), so compiling is not timed. The variants'
greedy tokens are compared (first tokens, then the decoded ones): a variant may change speed,
never answers. The engines take a fixed token budget per step (`target_itl_ms=0`): the latency
target sizes prompt chunks from measured step times, and a prompt chunked elsewhere may flip an
fp32 greedy near-tie, which would blur that comparison. Ends with one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import time

from backend_engine.llm import LLM
from backend_engine.sampling_params import SamplingParams
from benchmarks import results_file
from benchmarks.workloads import token_prompts

DEFAULT_VARIANTS = ("prompt_weights=per_call", "")


def parse_variant(text: str) -> dict[str, str]:
    """"KEY=VALUE,KEY=VALUE" (or "") as engine options."""
    return dict(item.split("=", 1) for item in text.split(",") if item)


def prompt_lengths(count: int, low: int, high: int) -> list[int]:
    return [low + (high - low) * i // max(count - 1, 1) for i in range(count)]


def run_variant(options: dict[str, str], prompts: list[list[int]], new_tokens: int,
                threads: int | None) -> dict:
    llm = LLM("default", num_threads=threads, engine_options=options, target_itl_ms=0)
    llm.generate([p[:300] for p in prompts[:2]], SamplingParams(max_tokens=2))  # warm-up
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, first)
    prefill_s = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    decoded = llm.generate(prompts, params)
    decode_s = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in decoded)
    result = {"prefill_tok_s": round(sum(map(len, prompts)) / prefill_s, 1),
              "decode_tok_s": round(produced / decode_s, 1),
              "prefill_s": round(prefill_s, 2), "decode_s": round(decode_s, 2),
              "first_tokens": [o.outputs[0].token_ids[0] for o in outs],
              "decoded_tokens": [list(o.outputs[0].token_ids) for o in decoded]}
    del llm
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--min-tokens", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=3000)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--variant", action="append", default=None, metavar="KEY=VALUE,...",
                    help=f"engine options of one variant (repeat; default {DEFAULT_VARIANTS})")
    args = ap.parse_args()
    variants = args.variant if args.variant is not None else list(DEFAULT_VARIANTS)

    from transformers import AutoTokenizer

    from backend_engine.model_loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default").folder)
    prompts = [token_prompts(tokenizer, 1, n, seed=i)[0]
               for i, n in enumerate(prompt_lengths(args.prompts, args.min_tokens,
                                                    args.max_tokens))]
    runs = {}
    for i, variant in enumerate(variants):
        label = variant or "plan"
        if label in runs:  # a variant given twice: its runs' spread is the machine's noise
            label = f"{label} #{i + 1}"
        r = runs[label] = run_variant(parse_variant(variant), prompts, args.new_tokens,
                                      args.threads)
        print(f"{label:32s} prefill {r['prefill_tok_s']:8.1f} tok/s   "
              f"decode {r['decode_tok_s']:7.1f} tok/s", flush=True)
    labels = list(runs)
    base = runs[labels[0]]
    summary = {"prompt_tokens": sum(map(len, prompts)), "prompts": len(prompts),
               "variants": {v: {k: r[k] for k in ("prefill_tok_s", "decode_tok_s")}
                            for v, r in runs.items()},
               "same_first_tokens": all(r["first_tokens"] == base["first_tokens"]
                                        for r in runs.values()),
               "same_decoded_tokens": all(r["decoded_tokens"] == base["decoded_tokens"]
                                          for r in runs.values())}
    if len(labels) > 1:
        last = runs[labels[-1]]
        summary["prefill_speedup"] = round(last["prefill_tok_s"] / base["prefill_tok_s"], 2)
        summary["decode_speedup"] = round(last["decode_tok_s"] / base["decode_tok_s"], 2)
    print(json.dumps(summary))
    results_file.write("long_prompts", summary, {"args": vars(args), "runs": {
        v: {k: x for k, x in r.items() if k != "decoded_tokens"} for v, r in runs.items()}})


if __name__ == "__main__":
    main()
