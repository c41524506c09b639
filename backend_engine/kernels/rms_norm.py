"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer.

One program per row, statistics in fp32. The fused form returns (norm(x + residual), x +
residual), the pair a Llama layer needs, with the sum rounded to the storage dtype before the
norm exactly as the unfused model computes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend_engine.kernels.common import KernelInputError, check_device


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, stride_x,
                     stride_r, stride_o, stride_ro, n_cols, eps, HAS_RESIDUAL: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # add in fp32, round once to the storage dtype: what torch's half-precision add does
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (x * inv_rms * weight).to(out_ptr.dtype.element_ty),
             mask=mask)


def _rows(x: torch.Tensor, hidden: int) -> torch.Tensor:
    if x.shape[-1] != hidden:
        raise KernelInputError(f"last dim {x.shape[-1]} does not match the weight ({hidden})")
    x = x.reshape(-1, hidden)
    return x if x.stride(1) == 1 else x.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    hidden = weight.shape[0]
    shape = x.shape
    x2 = _rows(x, hidden)
    r2 = _rows(residual, hidden) if residual is not None else x2
    if r2.shape != x2.shape or (residual is not None and residual.dtype != x.dtype):
        raise KernelInputError("x and residual must share shape and dtype")
    check_device(x2, r2, weight)
    out = torch.empty_like(x2)
    residual_out = torch.empty_like(x2) if residual is not None else out
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, residual_out, x2.stride(0),
                                         r2.stride(0), out.stride(0), residual_out.stride(0),
                                         hidden, eps, HAS_RESIDUAL=residual is not None,
                                         BLOCK=triton.next_power_of_2(hidden))
    return out.view(shape), residual_out.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over memory."""
    return _launch(x, residual, weight, eps)
