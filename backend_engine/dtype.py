"""`--dtype auto`: the compute dtype a device runs without losing the model's quality or the
engine's guarantees.

On CUDA: bfloat16 where the GPU computes it natively (Ampere and later), else float16. On every
CPU: float32. A CPU GEMM picks its kernel, and so its order of summation, by the shape of the
product, so a row's last bits depend on how many rows share its step; in bf16 (8 bits of
mantissa, on CPUs with AVX512-BF16 or AMX) that was enough to change a sequence's greedy tokens
with its batch, its chunking and its prefix-cache hits (tests/backend_engine/test_equivalence.py),
in float32 it is not. `--dtype bfloat16` there is faster and halves the KV cache, without that
guarantee. The quantised forms still multiply in bf16 where the CPU computes it natively, over
fixed row tiles that give a row the same bits wherever it sits (accel/cpu/tiles.py)."""

from __future__ import annotations

from pathlib import Path

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (none where it cannot be read)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    return next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                 if line.startswith("flags")), [])


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    flags = cpu_flags(cpuinfo)
    return any(flag in flags for flag in CPU_BF16_FLAGS)


def cpu_has_amx(cpuinfo: str | None = None) -> bool:
    """Intel AMX tiles with bf16 (Sapphire Rapids and later), which Inductor's GEMM templates
    multiply with."""
    flags = cpu_flags(cpuinfo)
    return "amx_tile" in flags and "amx_bf16" in flags


def resolve_dtype(dtype: str, device: str) -> str:
    """"auto" → bfloat16 or float32 for this device; any other value is returned as given."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        import torch

        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() \
            else "float16"
    return "float32"
