"""Tensor parallelism: per-step time of one replica on 1 and 2 ranks, split into compute and
communication, and the collectives a step makes, timed alone.

The engine runs on the same cores in total at every size (threads per rank = cores // ranks).
Model: random weights with SmolLM2-135M's width, depth, MLP and vocabulary but 8 query heads
of 72 and 4 KV heads (SmolLM2's own 9 and 3 split only in 3), or --model. Steps: a 256-token
prefill, and decode steps of 1 and 8 sequences. Communication is rank 0's time inside
collectives, waiting for a slower rank included; compute is the rest of the step. On CUDA
(--device cuda, for benchmarks/gpu_check.sh) NCCL runs asynchronously, so only step times and
the token check are reported. Ends with one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backend_engine.executor.worker import available_cores
from backend_engine.llm import LLM
from backend_engine.model_loader import resolve_model
from backend_engine.process_env import cache_root
from backend_engine.sampling_params import SamplingParams
from backend_engine.step_batch import StepBatch
from benchmarks import results_file

BENCH_MODEL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                   rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0)
PREFILL_TOKENS = 256
DECODE_BATCHES = (1, 8)


def bench_model() -> str:
    """The SmolLM2-shaped random model (built once, kept with the other cached models)."""
    target = cache_root() / "models" / "bench-llama-576x30-8h4kv-v1"
    if (target / "config.json").is_file():
        return str(target)
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default").folder)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **BENCH_MODEL)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # wide enough that greedy choices are not near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp / "model.safetensors"))
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, target)
    return str(target)


# -- the engine, step by step ----------------------------------------------------------------
def _comm(llm: LLM) -> tuple[float, int]:
    group = getattr(llm.engine.runner, "group", None)
    return (group.stats.seconds, group.stats.calls) if group is not None else (0.0, 0)


def _timed_step(llm: LLM) -> tuple[float, float, int, list]:
    seconds, calls = _comm(llm)
    started = time.perf_counter()
    outputs = llm.engine.step()
    elapsed = time.perf_counter() - started
    after_s, after_calls = _comm(llm)
    return elapsed, after_s - seconds, after_calls - calls, outputs


def _summary(samples: list[tuple[float, float, int]]) -> dict:
    step = statistics.median(s for s, _, _ in samples)
    comm = statistics.median(c for _, c, _ in samples)
    return {"step_ms": round(step * 1e3, 2), "comm_ms": round(comm * 1e3, 2),
            "compute_ms": round((step - comm) * 1e3, 2),
            "collectives": samples[-1][2], "steps": len(samples)}


def _prompts(count: int, length: int, salt: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(salt)
    return torch.randint(100, 40000, (count, length), generator=g).tolist()


def _prefill(llm: LLM, repeats: int) -> dict:
    samples = []
    for i, prompt in enumerate(_prompts(repeats, PREFILL_TOKENS, 1)):
        llm.engine.add_request(f"prefill-{i}", prompt, SamplingParams(max_tokens=1, temperature=0))
        while llm.engine.has_unfinished_requests():
            samples.append(_timed_step(llm)[:3])
    return _summary(samples)


def _decode(llm: LLM, batch: int, steps: int) -> tuple[dict, list[list[int]], list[list[float]]]:
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(_prompts(batch, 32, 2)):
        llm.engine.add_request(f"decode-{batch}-{i}", prompt, params)
    samples, finals = [], {}
    first = True
    while llm.engine.has_unfinished_requests():
        elapsed, comm, calls, outputs = _timed_step(llm)
        if not first and all(not o.finished for o in outputs) and len(outputs) == batch:
            samples.append((elapsed, comm, calls))
        first = False
        finals.update({o.request_id: o for o in outputs if o.finished})
    ordered = [finals[f"decode-{batch}-{i}"].outputs[0] for i in range(batch)]
    return (_summary(samples), [o.token_ids for o in ordered],
            [[lp.logprob for lp in o.logprobs] for o in ordered])


def run_engine(model: str, size: int, device: str, steps: int) -> dict:
    threads = max(1, available_cores() // size) if device == "cpu" else None
    started = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=size, num_threads=threads, device=device,
              num_kv_blocks=256, enable_prefix_caching=False)
    result: dict = {"ranks": size, "threads_per_rank": threads,
                    "start_s": round(time.perf_counter() - started, 1)}
    try:
        result["prefill_256"] = _prefill(llm, 3)
        tokens, logprobs = {}, {}
        for batch in DECODE_BATCHES:
            result[f"decode_{batch}"], tokens[batch], logprobs[batch] = _decode(llm, batch, steps)
    finally:
        llm.engine.close()
    return {"figures": result, "tokens": tokens, "logprobs": logprobs}


# -- the collectives alone, in their own two-process gloo group ---------------------------------
def _collectives_rank(rank: int, port: int, vocab: int, hidden: int, reps: int, box) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    out: dict = {}

    def timed(name: str, fn) -> None:  # the median call: a shared machine adds long stalls
        for _ in range(5):
            fn()
        dist.barrier()
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        out[name] = round(statistics.median(times) * 1e6, 1)

    for rows in (1, 8, PREFILL_TOKENS):
        x = torch.randn(rows, hidden)
        timed(f"all_reduce_{rows}x{hidden}_us", lambda x=x: dist.all_reduce(x))
    for rows in DECODE_BATCHES:
        logits = torch.randn(rows, vocab // 2)
        shards = [torch.empty_like(logits) for _ in range(2)] if rank == 0 else None
        timed(f"gather_logits_{rows}_rows_us", lambda: dist.gather(logits, shards, dst=0))

        def parallel_argmax(logits=logits) -> None:  # what parallel greedy sampling would send
            best = logits.max(dim=-1)
            pair = torch.stack([best.values, best.indices.float()], dim=-1)
            dist.all_gather([torch.empty_like(pair) for _ in range(2)], pair)
        timed(f"parallel_argmax_{rows}_rows_us", parallel_argmax)
    batch = StepBatch([[7]] * 8, [100] * 8, [101] * 8, [list(range(8))] * 8)
    timed("step_broadcast_8_seqs_us",
          lambda: dist.broadcast_object_list([batch if rank == 0 else None], src=0))
    dist.destroy_process_group()
    if rank == 0:
        box.put(out)


def collectives(vocab: int, hidden: int, reps: int) -> dict:
    context = mp.get_context("spawn")
    box = context.Queue()
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [context.Process(target=_collectives_rank, args=(r, port, vocab, hidden, reps, box))
             for r in range(2)]
    for p in procs:
        p.start()
    result = box.get(timeout=600)
    for p in procs:
        p.join(30)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the SmolLM2-shaped 8-head model")
    ap.add_argument("--sizes", default="1,2", help="tensor-parallel sizes to compare")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=24, help="decode steps per batch size")
    ap.add_argument("--reps", type=int, default=200, help="repetitions of each collective alone")
    args = ap.parse_args()
    model = args.model or bench_model()
    sizes = [int(s) for s in args.sizes.split(",")]
    runs = {size: run_engine(model, size, args.device, args.steps) for size in sizes}
    base = runs[sizes[0]]
    report: dict = {"model": Path(model).name, "device": args.device,
                    "cores": available_cores(), "load_average_1m": round(os.getloadavg()[0], 1)}
    for size, run in runs.items():
        figures = run["figures"]
        figures["tokens_match"] = run["tokens"] == base["tokens"]
        figures["max_logprob_diff"] = max(
            (abs(a - b) for batch in DECODE_BATCHES
             for mine, ref in zip(run["logprobs"][batch], base["logprobs"][batch])
             for a, b in zip(mine, ref)), default=0.0)
        report[f"tp{size}"] = figures
        print(f"TP={size} ({figures['threads_per_rank']} threads/rank): " + ", ".join(
            f"{k} {v['step_ms']} ms (comm {v['comm_ms']}, {v['collectives']} collectives)"
            for k, v in figures.items() if isinstance(v, dict)), flush=True)
    if args.device == "cpu":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(resolve_model(model).folder)
        report["collectives_alone"] = collectives(config.vocab_size, config.hidden_size, args.reps)
        print("collectives alone (2 gloo ranks, µs):", report["collectives_alone"], flush=True)
    print(json.dumps(report))
    results_file.write("tensor_parallel", report, {"args": vars(args)})


if __name__ == "__main__":
    main()
