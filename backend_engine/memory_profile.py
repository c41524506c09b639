"""Measure what a CUDA replica holds before its KV pool (kv_sizing.MemoryProfile): the weights,
the activations of a profiling forward at the largest step (a whole `max_num_batched_tokens`
prompt chunk, and the logits and probabilities of `max_num_seqs` rows), and what libraries took
outside torch's allocator. The profiling step runs over a temporary KV cache just large enough
for it, which is freed before the pool is allocated. `runner` is the ModelRunner being built
(this module sits below it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend_engine.kv_sizing import MemoryProfile
from backend_engine.step_cost import StepShape
from backend_engine.synthetic_step import step_inputs


@dataclass(frozen=True, slots=True)
class CudaSnapshot:
    """The device before this replica loaded anything."""

    free: int
    total: int
    allocated: int  # by torch in this process
    reserved: int

    @classmethod
    def take(cls, device: torch.device) -> CudaSnapshot:
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return cls(free, total, torch.cuda.memory_allocated(device),
                   torch.cuda.memory_reserved(device))


def profile_tokens(max_num_batched_tokens: int, max_model_len: int) -> int:
    """The largest step's prompt chunk: the budget, within one context."""
    return min(max_num_batched_tokens, max_model_len)


@torch.inference_mode()
def run_profile_step(runner, tokens: int, rows: int, max_model_len: int) -> torch.Tensor:
    """One forward of a `tokens`-token prompt chunk over runner.kv_caches, then the logits and
    float32 probabilities (returned) of `rows` rows, at most one a token: the sampler's
    working set."""
    shape = StepShape(prefill_tokens=tokens, attention_pairs=tokens * tokens)
    ids, positions, meta, _ = step_inputs(runner, shape, max_model_len)
    hidden = runner.forward_pass(ids, positions, runner.kv_caches, meta)
    logits = runner.forward_pass.compute_logits(hidden[:min(rows, tokens)])
    return torch.softmax(logits.float(), dim=-1)


def profile_cuda_memory(runner, baseline: CudaSnapshot, max_num_batched_tokens: int,
                        max_num_seqs: int, max_model_len: int, graph_bytes: int = 0
                        ) -> MemoryProfile:
    """Measure on the runner's device; leaves runner.kv_caches empty for the pool."""
    device = runner.device
    torch.cuda.synchronize(device)
    weights = torch.cuda.memory_allocated(device) - baseline.allocated
    tokens = profile_tokens(max_num_batched_tokens, max_model_len)
    runner.allocate_kv(-(-tokens // runner.block_size) + 1)
    before_step = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_profile_step(runner, tokens, max_num_seqs, max_model_len)
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - before_step
    runner.allocate_kv(0)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device) - baseline.reserved
    non_torch = max(0, (baseline.free - free) - reserved)
    return MemoryProfile(total, baseline.free, weights, activations, graph_bytes, non_torch)
