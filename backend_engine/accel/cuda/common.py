"""Small helpers shared by the kernel wrappers."""

from __future__ import annotations

import os

import torch
import triton.language as tl

LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) == exp2(x * LOG2E)


class KernelInputError(ValueError):
    """A tensor handed to a kernel wrapper has the wrong shape, dtype, device or layout."""


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (read at kernel definition time)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches should give fp32 answers; tf32 would cost ~1e-3 relative error on Ampere+.
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_dtype(dtype: torch.dtype):  # -> tl.dtype
    """What attention feeds tl.dot: the cache's dtype, except bf16 in the interpreter, whose
    numpy dot has no bf16: there the bf16 operands are widened to fp32, which is exact (bf16
    products fit fp32), so the tests see what a GPU's bf16 dot with fp32 accumulation gives."""
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16,
            torch.bfloat16: tl.bfloat16}[dtype]


def check_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise KernelInputError(
            f"kernel inputs live on different devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cpu" and not interpreting():
        raise KernelInputError(
            "triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tests)")


def check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Caches are [num_blocks, block_size, kv_heads, head_dim], contiguous, identical in layout."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise KernelInputError(f"k/v caches must share a 4-d shape, got {tuple(k_cache.shape)} "
                               f"and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelInputError("k/v caches must be contiguous")
    if k_cache.dtype != v_cache.dtype:
        raise KernelInputError("k/v caches must share a dtype")
