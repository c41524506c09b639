"""`--dtype auto`: the compute dtype a device runs fastest without losing the model's quality.

bfloat16 where the hardware computes it natively: CUDA GPUs with bf16 (Ampere and later), and
x86 CPUs with AVX512-BF16 or AMX-BF16, where bf16 matmuls run several times faster than fp32
(and the KV cache, read in full every decode step, is half the bytes). float32 elsewhere: on a
CPU without those instructions bf16 is emulated and slower than fp32. This is what vLLM users
get on the same hardware (its CPU backend defaults to bf16)."""

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
    return "bfloat16" if cpu_has_native_bf16() else "float32"
