"""Rotary position embedding (half-split / NeoX layout, as Hugging Face Llama uses) for q and k.

The cos/sin tables are the model's RotaryEmbedding tables ([max_positions, head_dim], each row
cat(f, f), scaling already folded in), so every RoPE variant the model supports works here; the
kernel only reads each row's first half. One program per token rotates all its q and k heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend_engine.kernels.common import KernelInputError, check_device


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, token, stride_st, stride_sh, stride_dt, stride_dh, cos, sin,
                  num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < num_heads)[:, None] & (offs_d < HALF)[None, :]
    src = src_ptr + token * stride_st + offs_h[:, None] * stride_sh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + token * stride_dt + offs_h[:, None] * stride_dh + offs_d[None, :]
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ty), mask=mask)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh,
                   stride_kot, stride_koh, stride_cos, num_q_heads, num_k_heads,
                   HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  num_q_heads, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  num_k_heads, HALF, BLOCK_HK, BLOCK_HALF)


def _heads_view(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 3:
        raise KernelInputError(f"{name} must be [tokens, heads, head_dim], got {tuple(x.shape)}")
    return x if x.stride(2) == 1 else x.contiguous()


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q [T, H, D] and k [T, KVH, D] at positions [T]; cos/sin [P, D]."""
    q, k = _heads_view(q, "q"), _heads_view(k, "k")
    tokens, _, head_dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != head_dim or positions.shape != (tokens,):
        raise KernelInputError("q, k and positions must agree on tokens and head_dim")
    if head_dim % 2 or cos.shape[-1] != head_dim or sin.shape != cos.shape:
        raise KernelInputError(f"cos/sin {tuple(cos.shape)} do not fit head_dim {head_dim}")
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    check_device(positions, q, k, cos, sin)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if tokens:
        half = head_dim // 2
        _rotary_kernel[(tokens,)](
            positions, q, k, q_out, k_out, cos, sin, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos.stride(0), q.shape[1], k.shape[1], HALF=half,
            BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(half))
    return q_out, k_out
