"""KV pool and step sizing per device class: the arithmetic on a fake device's figures, the
measurement's bookkeeping on a fake CUDA allocator, and the profiling step run on CPU."""

from __future__ import annotations

import pytest
import torch

from backend_engine.config import EngineConfig
from backend_engine.engine import for_device
from backend_engine.kv_sizing import GIB, KVPoolSize, MemoryProfile, kv_block_bytes, kv_pool_size

# SmolLM2-135M in bf16: 30 layers, 3 KV heads of 64, blocks of 16 tokens
BLOCK = kv_block_bytes(30, 16, 3, 64, 2)
H100 = MemoryProfile(total=80 * GIB, free_at_start=79 * GIB, weights=GIB // 4,
                     activations=2 * GIB, graphs=GIB // 8, non_torch=GIB // 2)


def test_kv_gets_what_utilization_leaves_after_weights_activations_and_graphs():
    size = kv_pool_size(BLOCK, gpu_memory_utilization=0.9, profile=H100)
    left = int(80 * GIB * 0.9) - GIB // 4 - 2 * GIB - GIB // 8 - GIB // 2
    assert size.num_blocks == left // BLOCK
    assert size.source == "--gpu-memory-utilization"
    half = kv_pool_size(BLOCK, gpu_memory_utilization=0.5, profile=H100)
    assert half.num_blocks == (40 * GIB - GIB // 4 - 2 * GIB - GIB // 8 - GIB // 2) // BLOCK


def test_explicit_sizes_win_on_any_device_and_cpu_keeps_its_gibibyte():
    assert kv_pool_size(BLOCK, num_kv_blocks=100, profile=H100).num_blocks == 100
    assert kv_pool_size(BLOCK, kv_cache_memory_gb=2.0, profile=H100).num_blocks \
        == 2 * GIB // BLOCK
    cpu = kv_pool_size(kv_block_bytes(30, 16, 3, 64, 4))  # float32 on CPU, no profile
    assert cpu.num_blocks == GIB // kv_block_bytes(30, 16, 3, 64, 4)
    assert cpu.source == "the CPU default 1 GiB"


def test_budget_beyond_free_memory_is_refused_naming_the_flag():
    busy = MemoryProfile(80 * GIB, 40 * GIB, GIB // 4, 2 * GIB, 0, 0)
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.9 asks for 72.00 GiB but "
                                         "only 40.00 GiB"):
        kv_pool_size(BLOCK, gpu_memory_utilization=0.9, profile=busy)
    assert kv_pool_size(BLOCK, gpu_memory_utilization=0.45, profile=busy).num_blocks > 0


def test_no_room_for_the_cache_is_refused():
    small = MemoryProfile(8 * GIB, 8 * GIB, 6 * GIB, GIB, 0, 0)
    with pytest.raises(ValueError, match="no room for the KV cache"):
        kv_pool_size(BLOCK, gpu_memory_utilization=0.8, profile=small)


def test_start_up_line_names_every_figure():
    line = kv_pool_size(BLOCK, gpu_memory_utilization=0.9, profile=H100).describe(16, 256, 8192)
    for part in ("KV pool", "tokens", "--gpu-memory-utilization 0.9 of 80.00 GiB",
                 "weights 0.25", "activations 2.00", "CUDA graphs 0.12", "other 0.50",
                 "max_num_seqs 256", "max_num_batched_tokens 8192"):
        assert part in line
    assert "GiB) from --num-kv-blocks; max_num_seqs 64" in KVPoolSize(8, BLOCK, "--num-kv-blocks"
                                                                        ).describe(16, 64, 512)


def test_step_limits_follow_the_device_class_unless_given():
    cpu, cuda = for_device(EngineConfig()), for_device(EngineConfig(device="cuda"))
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (64, 512)
    assert (cuda.max_num_seqs, cuda.max_num_batched_tokens) == (256, 8192)
    given = for_device(EngineConfig(device="cuda", max_num_seqs=8, max_num_batched_tokens=64))
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (8, 64)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5).validate()


@pytest.fixture(scope="module")
def runner():
    from backend_engine.llm import LLM

    return LLM("tiny-random", enforce_eager=True, num_kv_blocks=64,
               max_num_batched_tokens=128).engine.runner


def test_profiling_step_runs_the_largest_chunk_and_the_samplers_rows(runner):
    from backend_engine.memory_profile import run_profile_step

    probs = run_profile_step(runner, 128, 16, max_model_len=256)
    assert probs.shape == (16, runner.model.vocab_size) and probs.dtype == torch.float32
    assert torch.allclose(probs.sum(-1), torch.ones(16))


class FakeCuda:
    """A device's counters as torch.cuda reports them, scripted per call."""

    def __init__(self, allocated: list[int], peak: int, free_after: int, reserved: int):
        self.allocated, self.peak, self.free_after, self.reserved = allocated, peak, \
            free_after, reserved

    def install(self, monkeypatch):
        cuda = torch.cuda
        for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
            monkeypatch.setattr(cuda, name, lambda *a: None)
        monkeypatch.setattr(cuda, "memory_allocated", lambda *a: self.allocated.pop(0))
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda *a: self.peak)
        monkeypatch.setattr(cuda, "mem_get_info", lambda *a: (self.free_after, 80 * GIB))
        monkeypatch.setattr(cuda, "memory_reserved", lambda *a: self.reserved)


def test_measured_profile_separates_weights_activations_and_other(runner, monkeypatch):
    from backend_engine.memory_profile import CudaSnapshot, profile_cuda_memory

    baseline = CudaSnapshot(free=79 * GIB, total=80 * GIB, allocated=0, reserved=0)
    weights, step_kv, activations, other = GIB // 4, GIB // 64, 3 * GIB, GIB // 2
    reserved = weights + step_kv + activations  # what torch keeps after empty_cache
    FakeCuda(allocated=[weights, weights + step_kv], peak=weights + step_kv + activations,
             free_after=79 * GIB - reserved - other, reserved=reserved).install(monkeypatch)
    blocks = runner.num_blocks
    try:
        profile = profile_cuda_memory(runner, baseline, 128, 16, 256)
    finally:
        monkeypatch.undo()
        runner.allocate_kv(blocks)
    assert profile == MemoryProfile(80 * GIB, 79 * GIB, weights, activations, 0, other)
