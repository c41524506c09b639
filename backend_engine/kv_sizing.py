"""How large a replica's KV pool and steps are, per device class: the one function that sizes
the pool on every device, with each class's policy. CPU: a fixed size (1 GiB unless told).
CUDA: vLLM's `--gpu-memory-utilization` — the replica may use that fraction of the device's
total memory; the weights, the activations of a profiled largest step, CUDA-graph pools and
memory outside torch's allocator come out of it, and the KV cache gets the rest. An explicit
`--num-kv-blocks` or `--kv-cache-memory` wins on any device. Torch-free: the figures come in
(memory_profile.py measures them on CUDA), so the arithmetic is tested anywhere."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
CPU_KV_CACHE_GB = 1.0
# (max_num_seqs, max_num_batched_tokens) by device class: a CPU step's cost grows with its
# tokens at a few thousand tokens a second, a GPU's stays flat far beyond (vLLM's GPU defaults)
STEP_LIMITS = {"cpu": (64, 512), "cuda": (256, 8192)}


def step_limits(device: str) -> tuple[int, int]:
    """The device class's (max_num_seqs, max_num_batched_tokens)."""
    return STEP_LIMITS["cuda" if device.startswith("cuda") else "cpu"]


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """What a device holds before the KV pool, in bytes, as measured at start-up."""

    total: int  # the device's memory
    free_at_start: int  # free before this replica loaded anything
    weights: int
    activations: int  # the peak of a profiling forward at the largest step, above the weights
    graphs: int  # CUDA-graph memory pools
    non_torch: int  # used outside torch's allocator since start (CUDA libraries' workspaces)


@dataclass(frozen=True, slots=True)
class KVPoolSize:
    num_blocks: int
    block_bytes: int
    source: str  # the flag that decided it
    utilization: float | None = None
    profile: MemoryProfile | None = None

    def describe(self, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> str:
        """The start-up line: the pool, what decided it, and the step limits."""
        pool = (f"KV pool {self.num_blocks} blocks = {self.num_blocks * block_size} tokens "
                f"({_gib(self.num_blocks * self.block_bytes)} GiB) from {self.source}")
        if self.profile is not None:
            p = self.profile
            pool += (f" {self.utilization:g} of {_gib(p.total)} GiB (weights {_gib(p.weights)}, "
                     f"activations {_gib(p.activations)}, CUDA graphs {_gib(p.graphs)}, "
                     f"other {_gib(p.non_torch)} GiB)")
        return (f"{pool}; max_num_seqs {max_num_seqs}, max_num_batched_tokens "
                f"{max_num_batched_tokens}")


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype_bytes: int) -> int:
    """K and V of one block in every layer."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def kv_pool_size(block_bytes: int, *, num_kv_blocks: int | None = None,
                 kv_cache_memory_gb: float | None = None, gpu_memory_utilization: float = 0.9,
                 profile: MemoryProfile | None = None) -> KVPoolSize:
    """The pool's size: blocks given, else GiB given, else (CPU, no profile) the CPU's size,
    else what `gpu_memory_utilization` of the profiled device leaves. ValueError when the
    device cannot hold the budget or the budget leaves no room for two blocks."""
    if num_kv_blocks is not None:
        return KVPoolSize(num_kv_blocks, block_bytes, "--num-kv-blocks")
    if kv_cache_memory_gb is not None or profile is None:
        gib = CPU_KV_CACHE_GB if kv_cache_memory_gb is None else kv_cache_memory_gb
        source = "--kv-cache-memory" if kv_cache_memory_gb is not None else "the CPU default"
        return KVPoolSize(max(2, int(gib * GIB) // block_bytes), block_bytes,
                          f"{source} {gib:g} GiB")
    budget = int(profile.total * gpu_memory_utilization)
    if profile.free_at_start < budget:
        raise ValueError(
            f"--gpu-memory-utilization {gpu_memory_utilization:g} asks for {_gib(budget)} GiB "
            f"but only {_gib(profile.free_at_start)} GiB of {_gib(profile.total)} GiB were free "
            "at start-up (another process holds the rest): lower it or free the device")
    used = profile.weights + profile.activations + profile.graphs + profile.non_torch
    num_blocks = (budget - used) // block_bytes
    if num_blocks < 2:
        raise ValueError(
            f"--gpu-memory-utilization {gpu_memory_utilization:g} ({_gib(budget)} GiB) leaves "
            f"no room for the KV cache after weights, activations and graphs "
            f"({_gib(used)} GiB): raise it, or lower --max-num-batched-tokens")
    return KVPoolSize(num_blocks, block_bytes, "--gpu-memory-utilization",
                      gpu_memory_utilization, profile)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"
