"""End-to-end generation throughput on one GPU: the kvgate engine (Triton attention) against
transformers `generate` with static batches of the same size, default model, bf16, greedy.
Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import time

import torch

from backend_engine.llm import LLM
from backend_engine.model_loader import resolve_model
from backend_engine.sampling_params import SamplingParams
from benchmarks.workloads import token_prompts


def engine_tok_s(prompts: list[list[int]], new_tokens: int, concurrency: int,
                 dtype: str) -> float:
    llm = LLM("default", device="cuda", dtype=dtype,
              max_num_seqs=concurrency, max_num_batched_tokens=4096, kv_cache_memory_gb=4.0)
    if llm.engine.runner.attention.name != "triton":
        raise RuntimeError("the engine did not pick the triton backend on CUDA")
    llm.generate(prompts[:concurrency], SamplingParams(max_tokens=4))  # compile the kernels
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def hf_tok_s(prompts: list[list[int]], new_tokens: int, concurrency: int,
             dtype: torch.dtype) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model("default").folder,
                                                 dtype=dtype).cuda().eval()

    def batch_inputs(batch: list[list[int]]) -> dict:
        width = max(map(len, batch))  # left padding, as decoder-only batching needs
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        return {"input_ids": ids.cuda(), "attention_mask": mask.cuda()}

    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0)
    model.generate(**batch_inputs(prompts[:2]), **{**kwargs, "max_new_tokens": 2,
                                                    "min_new_tokens": 2})  # warm-up
    torch.cuda.synchronize()
    produced, start = 0, time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        inputs = batch_inputs(prompts[i:i + concurrency])
        out = model.generate(**inputs, **kwargs)
        produced += (out.shape[1] - inputs["input_ids"].shape[1]) * out.shape[0]
    torch.cuda.synchronize()
    return produced / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default").folder)
    prompts = token_prompts(tokenizer, args.requests, args.prompt_tokens)
    ours = engine_tok_s(prompts, args.new_tokens, args.concurrency, args.dtype)
    theirs = hf_tok_s(prompts, args.new_tokens, args.concurrency, getattr(torch, args.dtype))
    print(json.dumps({"engine_tok_s": round(ours, 1), "hf_tok_s": round(theirs, 1),
                      "engine_vs_hf": round(ours / theirs, 2), "requests": args.requests,
                      "concurrency": args.concurrency, "dtype": args.dtype}))


if __name__ == "__main__":
    main()
