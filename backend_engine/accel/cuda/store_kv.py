"""Scatter a step's new K/V rows into the paged cache by slot mapping.

One program per token copies its whole row (kv_heads * head_dim values). Triton ranges must be a
power of two, and rows often are not (SmolLM2: 3 * 64 = 192), so the range is padded and masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend_engine.accel.cuda.common import KernelInputError, check_device, check_paged_cache


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     key_stride, value_stride, row_size, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token of a fixed-size (CUDA-graph) batch: nothing to write
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < row_size
    key = tl.load(key_ptr + token * key_stride + offs, mask=mask)
    value = tl.load(value_ptr + token * value_stride + offs, mask=mask)
    tl.store(k_cache_ptr + slot * row_size + offs, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * row_size + offs, value.to(v_cache_ptr.dtype.element_ty),
             mask=mask)


def _rows(x: torch.Tensor, kv_heads: int, head_dim: int) -> torch.Tensor:
    """[tokens, kv_heads, head_dim] with each token's row contiguous (the token stride is free,
    so slices of a fused qkv projection need no copy)."""
    if x.dim() != 3 or tuple(x.shape[1:]) != (kv_heads, head_dim):
        raise KernelInputError(f"expected [tokens, {kv_heads}, {head_dim}], got {tuple(x.shape)}")
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        x = x.contiguous()
    return x


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [tokens, kv_heads, head_dim] into the caches at slot_mapping [tokens]
    (slot = block_id * block_size + offset; negative slots are skipped)."""
    check_paged_cache(k_cache, v_cache)
    kv_heads, head_dim = k_cache.shape[2:]
    key, value = _rows(key, kv_heads, head_dim), _rows(value, kv_heads, head_dim)
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens or slot_mapping.shape != (num_tokens,):
        raise KernelInputError("key, value and slot_mapping must have one entry per token")
    check_device(key, value, k_cache, slot_mapping)
    if num_tokens == 0:
        return
    row_size = kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](key, value, k_cache, v_cache, slot_mapping,
                                    key.stride(0), value.stride(0), row_size,
                                    BLOCK=triton.next_power_of_2(row_size))
