"""The `int8_sums` form of prompt rows: int8 x int8 sums by `torch._int_mm`.

Where a CPU's int8 GEMM (oneDNN under `torch._int_mm`: VNNI dot products on `cpu-avx512`) runs
far faster than its bf16 one, prompt rows of quantised weights take this form (accel/plan.py):
- the weight as int8 per output channel: int8 weights as stored; int4 weights requantised for
  the call, ((q - 8) * scale + zero) / channel scale rounded, where the channel scale is
  max |w| / 127 over the channel (computed once at load: `CpuInt4Weight.int8_scales`); one
  fused loop per weight shape (compiled, static shapes);
- each activation row as two int8 digits: with u = x * 127 / max |x| of the row, hi = round(u)
  and lo = round((u - hi) * 254), x = max / 127 * (hi + lo / 254) to ~15 bits of the row's
  largest element (bf16 keeps 8 bits of each). One digit alone (llama.cpp's Q8 activations,
  one scale per row) costs SmolLM2 too much perplexity: its rows carry outlier channels 10-25x
  their median, which squeeze every other channel into a few levels. One `_int_mm` over the 2M
  digit rows gives both sums;
- y = (sum_hi + sum_lo / 254) * row scale * channel scale, in the activations' dtype.

The integer sums are exact whatever blocking oneDNN picks for a row count, and everything else
is per row or per element, so a row's bits depend on the row alone: no fixed tiles needed
(tested at every offset and with any neighbours). int32 cannot overflow below ~133,000 input
channels (127 x 127 a term).
"""

from __future__ import annotations

import torch

from backend_engine.accel.compile import Compiled
from backend_engine.accel.cpu.kernels import CpuInt4Weight, CpuInt8Weight
from backend_engine.accel.cpu.tiles import unpack_int4

LOW_DIGIT = 254  # the low digit's unit: the high digit's rounding step (1) in 254ths


def digits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → int8 [2M, K] (the high digits of every row, then the low ones) and each row's
    scale [M, 1] (fp32): x ~= scale * (hi + lo / LOW_DIGIT)."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127
    u = xf / scale
    hi = u.round()
    lo = ((u - hi) * LOW_DIGIT).round()
    return torch.cat([hi, lo]).to(torch.int8), scale


def combine(sums: torch.Tensor, row_scales: torch.Tensor, channel_scales: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """int32 sums [2M, N] of `digits` times int8 weights with channel scales [N] → y [M, N]."""
    m = row_scales.shape[0]
    hi, lo = sums[:m].float(), sums[m:].float()
    return ((hi + lo / LOW_DIGIT) * row_scales * channel_scales).to(dtype)


def requantize_int4(packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                    int8_scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """torch's packed int4 weight [N_padded, K] → int8 per channel: each value's
    (q - 8) * scale + zero over its channel's int8 scale, rounded (the group's scale and zero
    divided first, once per group)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    v = unpack_int4(packed).view(n, k // group_size, group_size).float()
    sz = scales_and_zeros.float() / int8_scales[None, :, None]  # [K // group_size, N, 2]
    a, b = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]
    return (v * a + (b - 8.0 * a)).round().clamp(-127, 127).view(n, k).to(torch.int8)


_digits = Compiled(digits, "the activation digits", dynamic=True)
_combine = Compiled(combine, "the integer sums' scaling", dynamic=True)
_requantize_int4 = Compiled(requantize_int4, "the int4 requantisation", per_shape=True)


def _int8_sums(x: torch.Tensor, weight: torch.Tensor, channel_scales: torch.Tensor,
               out_features: int) -> torch.Tensor:
    """x [M, K] times int8 weight [N, K] (transposed) → y [M, out_features] in x's dtype."""
    m = x.shape[0]
    if m == 1:  # one row would specialise the dynamic graphs: pad to two (a zero row)
        x = torch.cat([x, x.new_zeros(1, x.shape[1])])
    q, row_scales = _digits(x)
    sums = torch._int_mm(q, weight.t())[:, :out_features]  # int4's padding channels dropped
    y = _combine(sums, row_scales, channel_scales[:out_features], x.dtype)
    return y[:m] if m == 1 else y


@torch.library.custom_op("kvgate::int8_weight_int8_mm", mutates_args=())
def int8_weight_int8_mm(x: torch.Tensor, qweight: torch.Tensor,
                        scales: torch.Tensor) -> torch.Tensor:
    """Prompt rows times an int8 weight [N, K] with fp32 channel scales [N], in integers."""
    return _int8_sums(x, qweight, scales, qweight.shape[0])


@int8_weight_int8_mm.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


@torch.library.custom_op("kvgate::int4_weight_int8_mm", mutates_args=())
def int4_weight_int8_mm(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                        int8_scales: torch.Tensor, group_size: int,
                        out_features: int) -> torch.Tensor:
    """Prompt rows times an int4 weight requantised to int8 for the call, in integers."""
    weight = _requantize_int4(packed, scales_and_zeros, int8_scales, group_size)
    return _int8_sums(x, weight, int8_scales, out_features)


@int4_weight_int8_mm.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
      int8_scales: torch.Tensor, group_size: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def int8_weight_sums(x: torch.Tensor, w: CpuInt8Weight) -> torch.Tensor:
    return int8_weight_int8_mm(x, w.qweight, w.scales_fp32)


def int4_weight_sums(x: torch.Tensor, w: CpuInt4Weight) -> torch.Tensor:
    if w.perm is not None:
        x = x.index_select(1, w.perm)
    return int4_weight_int8_mm(x, w.packed, w.scales_and_zeros, w.int8_scales, w.group_size,
                               w.out_features)
