"""Offline throughput of the kvgate engine against transformers, in one run.

32 requests, ~128-token prompts, 128 output tokens each, up to 16 at once, default model, every
engine in the same dtype (`--dtype`, fp32 by default; bf16 is 3-5x faster for matmul on CPUs
with AVX512-BF16):
- kvgate: LLM.generate over all 32 (continuous batching, max_num_seqs=16);
- hf: transformers `generate`, one request at a time, on a subset (it is slow on CPU);
- hf_cb: transformers' own continuous batching (`generate_batch`, attn "paged|sdpa") on all 32;
- llamacpp (only if llama-cpp-python is installed): the GGUF served one request at a time.
Ends with one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from backend_engine.cli_args import key_value
from backend_engine.llm import LLM
from backend_engine.model_loader import default_gguf_path, resolve_model
from backend_engine.sampling_params import SamplingParams
from benchmarks import results_file
from benchmarks.workloads import token_prompts


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def run_kvgate(prompts, new_tokens: int, concurrency: int, dtype: str,
               quantization: str | None = None,
               engine_options: dict[str, str] | None = None,
               target_itl_ms: float | None = None) -> float:
    llm = LLM("default", max_num_seqs=concurrency, max_num_batched_tokens=512, dtype=dtype,
              quantization=quantization, engine_options=engine_options or {},
              target_itl_ms=target_itl_ms)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return produced / elapsed


def run_hf_sequential(prompts, new_tokens: int, dtype: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model("default").folder,
                                                 dtype=DTYPES[dtype]).eval()
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False)  # warm-up
    produced, start = 0, time.perf_counter()
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
        produced += out.shape[1] - len(p)
    return produced / (time.perf_counter() - start)


def run_hf_continuous_batching(prompts, new_tokens: int, concurrency: int, dtype: str) -> float:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(resolve_model("default").folder,
                                                 dtype=DTYPES[dtype],
                                                 attn_implementation="paged|sdpa").eval()
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, eos_token_id=-1, pad_token_id=0,
                              max_batch_tokens=512, num_blocks=2048, block_size=16)
    kwargs = {}
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
            max_batch_tokens=512, num_blocks=2048, block_size=16)
    except (ImportError, TypeError):
        pass
    start = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=config, **kwargs)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.generated_tokens) for o in out.values())
    return produced / elapsed


def run_llamacpp(prompts, new_tokens: int) -> float | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(default_gguf_path()), n_ctx=1024, verbose=False)
    produced, start = 0, time.perf_counter()
    for p in prompts:
        llm.reset()
        for i, _ in enumerate(llm.generate(p, temp=0.0)):
            if i + 1 >= new_tokens:
                break
        produced += new_tokens
    return produced / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--hf-subset", type=int, default=4)
    ap.add_argument("--skip-hf-cb", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                    help="kvgate's weights (the transformers baselines stay fp in --dtype: "
                         "none compares like with like)")
    ap.add_argument("--engine-option", action="append", type=key_value, default=[],
                    metavar="KEY=VALUE",
                    help="kvgate's plan overrides, as `kvgate engine --engine-option` (e.g. "
                         "decode=kernel: how decode rows multiply quantised weights)")
    ap.add_argument("--target-itl-ms", type=float, default=None,
                    help="kvgate's step budget: the ITL its prefill share is sized for (default: "
                         "the engine's, 250 ms on CPU); 0: a fixed --max-num-batched-tokens "
                         "budget of 512, as engines before the ITL target ran")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default").folder)
    prompts = token_prompts(tokenizer, args.requests, args.prompt_tokens)
    ours = run_kvgate(prompts, args.new_tokens, args.concurrency, args.dtype, args.quantization,
                      dict(args.engine_option), args.target_itl_ms)
    print(f"kvgate                      {ours:8.1f} tok/s  ({args.requests} requests)")
    hf = run_hf_sequential(prompts[:args.hf_subset], args.new_tokens, args.dtype)
    print(f"transformers generate (1x1) {hf:8.1f} tok/s  ({args.hf_subset} requests)")
    result = {"speedup_vs_hf": round(ours / hf, 2), "kvgate_tok_s": round(ours, 1),
              "hf_tok_s": round(hf, 2), "dtype": args.dtype, "quantization": args.quantization,
              "engine_options": dict(args.engine_option), "target_itl_ms": args.target_itl_ms}
    if not args.skip_hf_cb:
        hf_cb = run_hf_continuous_batching(prompts, args.new_tokens, args.concurrency,
                                           args.dtype)
        print(f"transformers generate_batch {hf_cb:8.1f} tok/s  ({args.requests} requests)")
        result.update(speedup_vs_hf_cb=round(ours / hf_cb, 2), hf_cb_tok_s=round(hf_cb, 1))
    llamacpp = run_llamacpp(prompts[:args.hf_subset], args.new_tokens)
    if llamacpp is not None:
        print(f"llama.cpp (1x1)             {llamacpp:8.1f} tok/s")
        result.update(llamacpp_tok_s=round(llamacpp, 1),
                      speedup_vs_llamacpp=round(ours / llamacpp, 2))
    print(json.dumps(result))
    variant = [v for v in (args.quantization, args.dtype if args.dtype != "float32" else None) if v]
    results_file.write("engine_throughput", result, {"args": vars(args)},
                       name="_".join(["engine_throughput", *variant]))


if __name__ == "__main__":
    main()
