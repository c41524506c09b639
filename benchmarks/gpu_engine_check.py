"""The engine on a GPU, two figures in one run (benchmarks/gpu_check.py runs it as a stage):
- parity: the same weights on CUDA and on CPU in float32, greedy: tokens identical, logprobs of
  the chosen tokens within a tolerance (sampling ran on each device's own logits);
- decode: tokens a second of pure decode steps at 1/16/64 rows in bf16 and int8, eager (CUDA
  graphs for decode are not built yet: their figures are null), with a profile of the 16-row
  bf16 step (kernels a step, the fraction of wall time the GPU was busy).
`--device cpu` runs the same code on CPU at a small size (a smoke run). Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoTokenizer

from backend_engine.llm import LLM
from backend_engine.model_loader import resolve_model
from backend_engine.sampling_params import SamplingParams
from benchmarks import results_file
from benchmarks.gpu_model import check_model
from benchmarks.workloads import token_prompts

LOGPROB_TOLERANCE = 2e-3


def parity(model: str, device: str, prompts: list[list[int]], new_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    runs = {}
    for where in ("cpu", device):
        llm = LLM(model, device=where, dtype="float32", quantization="none", enforce_eager=True,
                  num_kv_blocks=256, max_num_seqs=len(prompts), max_num_batched_tokens=1024)
        runs[where] = llm.generate(prompts, params)
        del llm
    tokens = {w: [o.outputs[0].token_ids for o in outs] for w, outs in runs.items()}
    logprobs = {w: [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs]
                for w, outs in runs.items()}
    diffs = [abs(a - b) for ra, rb in zip(logprobs["cpu"], logprobs[device])
             for a, b in zip(ra, rb)]
    same = tokens["cpu"] == tokens[device]
    return {"tokens_identical": same, "sequences": len(prompts), "new_tokens": new_tokens,
            "max_logprob_diff": round(max(diffs), 6), "logprob_tolerance": LOGPROB_TOLERANCE,
            "logprobs_within_tolerance": max(diffs) <= LOGPROB_TOLERANCE,
            "first_mismatch": None if same else next(
                i for i, (a, b) in enumerate(zip(tokens["cpu"], tokens[device])) if a != b)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _start_decoding(llm: LLM, prompts: list[list[int]], steps: int) -> None:
    """Admit every prompt and run steps until all of them decode (prefill done)."""
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    for i, tokens in enumerate(prompts):
        llm.engine.add_request(f"decode-{i}", tokens, params)
    scheduler = llm.engine.scheduler
    while len(scheduler.waiting) or any(seq.num_computed_tokens < seq.num_prompt_tokens
                                        for seq in scheduler.running):
        llm.engine.step()


def decode_rate(llm: LLM, prompts: list[list[int]], steps: int, device: str) -> float:
    """Tokens a second over `steps` steps of len(prompts) decoding rows."""
    _start_decoding(llm, prompts, steps)
    llm.engine.step()  # warm: the kernels for this batch size are compiled
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    _sync(device)
    rate = len(prompts) * steps / (time.perf_counter() - start)
    for i in range(len(prompts)):
        llm.engine.abort_request(f"decode-{i}")
    return rate


def step_profile(llm: LLM, prompts: list[list[int]], steps: int) -> dict:
    """Kernels a decode step and the GPU-busy fraction of its wall time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    _start_decoding(llm, prompts, steps + 1)
    llm.engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            llm.engine.step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    # kernels, copies and memsets: what the GPU ran (one stream: they do not overlap)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    for i in range(len(prompts)):
        llm.engine.abort_request(f"decode-{i}")
    return {"rows": len(prompts), "device_ops_per_step": round(len(kernels) / steps, 1),
            "gpu_busy_fraction": round(busy_us / wall_us, 3),
            "step_ms": round(wall_us / steps / 1000, 3)}


def decode(model: str, device: str, prompts: list[list[int]], rows: list[int],
           steps: int) -> dict:
    result: dict = {}
    for dtype, quantization in (("bfloat16", "none"), ("bfloat16", "int8")):
        llm = LLM(model, device=device, dtype=dtype, quantization=quantization,
                  enforce_eager=True, max_num_seqs=max(rows), num_kv_blocks=max(rows) * 16,
                  max_num_batched_tokens=4096)
        name = "bf16" if quantization == "none" else quantization
        for n in rows:
            result[f"{name}_{n}_rows"] = {
                "eager_tok_s": round(decode_rate(llm, prompts[:n], steps, device), 1),
                "graphs_tok_s": None}
        if name == "bf16" and device.startswith("cuda"):
            result["profile"] = step_profile(llm, prompts[:min(16, max(rows))], 8)
        del llm
    result["graphs"] = "not built: CUDA-graph capture of the decode step is future work"
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--parity-prompts", type=int, default=4)
    ap.add_argument("--parity-tokens", type=int, default=24)
    ap.add_argument("--random-weights", action="store_true",
                    help="the default shape with random weights even where the GGUF is installed")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    model = check_model(args.random_weights)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model).folder)
    prompts = token_prompts(tokenizer, max(rows + [args.parity_prompts]), 32)
    result = {"model": model if model == "default" else "random weights, default shape",
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda")
              else "cpu"}
    result["parity"] = parity(model, args.device, prompts[:args.parity_prompts],
                              args.parity_tokens)
    result["decode"] = decode(model, args.device, prompts, rows, args.steps)
    print(json.dumps(result))
    results_file.write("gpu_engine_check", result, {"args": vars(args)})


if __name__ == "__main__":
    main()
