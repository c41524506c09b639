"""Weight-only quantised matmul for CUDA: y = x @ dequant(W)^T with W int8 per output channel or
int4 in groups (w = q * scale + min, two values a byte, low nibble first; the canonical layouts
of backend_engine/quant/formats.py, read as stored).

One kernel per format, two launch shapes: decode (few rows, GEMV-like: 16-row tiles, wide N
tiles, long K steps so each weight byte is read once per step) and prefill (GEMM tiles). Weights
are dequantised in registers tile by tile and fed to tl.dot in fp32 accumulation; nothing
dequantised is written to memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend_engine.accel.cuda.common import KernelInputError, check_device, dot_precision

DECODE_MAX_ROWS = 16
_DECODE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4)
_PREFILL = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4)


@triton.jit
def _int8_kernel(x_ptr, q_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_qn, stride_om,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        q = tl.load(q_ptr + offs_n[None, :] * stride_qn + offs_k[:, None],
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0)
        acc += tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision=PRECISION)
    scale = tl.load(scale_ptr + offs_n, mask=offs_n < N, other=0.0)
    out = acc * scale[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _int4_kernel(x_ptr, q_ptr, scale_ptr, min_ptr, out_ptr, M, N, K, stride_xm, stride_qn,
                 stride_sn, stride_om, GROUP: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        w_mask = (offs_n[None, :] < N) & k_ok[:, None]
        packed = tl.load(q_ptr + offs_n[None, :] * stride_qn + offs_k[:, None] // 2,
                         mask=w_mask, other=0)
        q = (packed >> ((offs_k[:, None] % 2) * 4).to(tl.uint8)) & 0xF
        group = offs_k[:, None] // GROUP
        scale = tl.load(scale_ptr + offs_n[None, :] * stride_sn + group, mask=w_mask, other=0.0)
        low = tl.load(min_ptr + offs_n[None, :] * stride_sn + group, mask=w_mask, other=0.0)
        w = q.to(tl.float32) * scale + low  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x.to(tl.float32), w, input_precision=PRECISION)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _launch_shape(m: int) -> dict:
    return _DECODE if m <= DECODE_MAX_ROWS else _PREFILL


def _check(x: torch.Tensor, qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != in_features:
        raise KernelInputError(f"x must be [rows, {in_features}], got {tuple(x.shape)}")
    if not qweight.is_contiguous():
        raise KernelInputError("quantised weights must be contiguous")
    return x if x.stride(1) == 1 else x.contiguous()


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] (fp32/bf16/fp16), qweight int8 [N, K], scales fp32 [N] → [M, N] in x's dtype."""
    n, k = qweight.shape
    x = _check(x, qweight, k)
    if qweight.dtype != torch.int8 or scales.shape != (n,):
        raise KernelInputError("int8 weights need int8 [N, K] values and [N] scales")
    check_device(x, qweight, scales)
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    shape = _launch_shape(m)
    grid = (triton.cdiv(m, shape["BLOCK_M"]), triton.cdiv(n, shape["BLOCK_N"]))
    _int8_kernel[grid](x, qweight, scales.float().contiguous(), out, m, n, k, x.stride(0),
                       qweight.stride(0), out.stride(0), PRECISION=dot_precision(x.dtype),
                       **shape)
    return out


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                mins: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K], qweight uint8 [N, K/2], scales/mins fp32 [N, K/group_size] → [M, N]."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    x = _check(x, qweight, k)
    if qweight.dtype != torch.uint8 or k % group_size:
        raise KernelInputError("int4 weights need uint8 [N, K/2] values and K % group_size == 0")
    if scales.shape != (n, k // group_size) or mins.shape != scales.shape:
        raise KernelInputError(f"scales and mins must be [{n}, {k // group_size}]")
    check_device(x, qweight, scales, mins)
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    scales, mins = scales.float().contiguous(), mins.float().contiguous()
    shape = _launch_shape(m)
    grid = (triton.cdiv(m, shape["BLOCK_M"]), triton.cdiv(n, shape["BLOCK_N"]))
    _int4_kernel[grid](x, qweight, scales, mins, out, m, n, k, x.stride(0), qweight.stride(0),
                       scales.stride(0), out.stride(0), GROUP=group_size,
                       PRECISION=dot_precision(x.dtype), **shape)
    return out
