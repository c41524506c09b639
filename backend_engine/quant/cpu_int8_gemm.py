"""Prompt rows of quantised CPU weights in integers: int8 x int8 sums by `torch._int_mm`.

On a CPU with AVX512-VNNI but no AMX, oneDNN's int8 GEMM under `torch._int_mm` runs ~3x faster
than its fp32 GEMM and ~6x faster than its bf16 one (SmolLM2's 3072 x 576 at 128 rows, 2 cores:
~790, ~230 and ~135 GFLOP/s; the int4 kernel ~110), so prompt rows may take this form:
- the weight as int8 per output channel: int8 weights as stored; int4 weights requantised for
  the call, ((q - 8) * scale + zero) / channel scale rounded, where the channel scale is
  max |w| / 127 over the channel (computed once at load: `CpuInt4Weight.int8_scales`); one
  fused loop per weight shape (Inductor, static shapes), ~1.6 ms for a SmolLM2 layer's four
  weights on 2 cores. Against the int4 weight itself that rounding adds ~1/16 of its step;
- each activation row as two int8 digits: with u = x * 127 / max |x| of the row, hi = round(u)
  and lo = round((u - hi) * 254), x = max / 127 * (hi + lo / 254) to ~15 bits of the row's
  largest element (bf16 keeps 8 bits of each). One digit alone (llama.cpp's Q8 activations
  with one scale per row) cost SmolLM2 perplexity x1.032 against fp32: its rows carry
  outlier channels 10-25x their median, which squeeze every other channel into a few levels.
  Two cost x1.0078 (dequantise-then-GEMM in bf16: x1.0053). One `_int_mm` over the 2M digit
  rows gives both sums;
- y = (sum_hi + sum_lo / 254) * row scale * channel scale, in the activations' dtype.

The integer sums are exact whatever blocking oneDNN picks for a row count, and everything else
is per row or per element, so a row's bits depend on the row alone: no fixed tiles needed
(tested at every offset and with any neighbours). int32 cannot overflow below ~133,000 input
channels (127 x 127 a term). The start-up measurement (models/linear.py) picks this form only
where it is the fastest; on AMX CPUs the GEMM template is.
"""

from __future__ import annotations

import torch

from backend_engine.quant.cpu import CpuInt4Weight, CpuInt8SumsWeight, CpuInt8Weight
from backend_engine.quant.cpu_gemm import Compiled, unpack_int4

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


_digits = Compiled(digits, dynamic=True)
_combine = Compiled(combine, dynamic=True)
_requantize_int4 = Compiled(requantize_int4)  # a fused loop per weight shape


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


def int8_int8(x: torch.Tensor, w: CpuInt8Weight) -> torch.Tensor:
    return int8_weight_int8_mm(x, w.qweight, w.scales_fp32)


def int4_int8(x: torch.Tensor, w: CpuInt4Weight) -> torch.Tensor:
    if w.perm is not None:
        x = x.index_select(1, w.perm)
    return int4_weight_int8_mm(x, w.packed, w.scales_and_zeros, w.int8_scales, w.group_size,
                               w.out_features)


FORMS = {CpuInt8Weight.kind: int8_int8, CpuInt4Weight.kind: int4_int8}  # prompt rows


def int8_sums(x: torch.Tensor, w: CpuInt8Weight) -> torch.Tensor:
    """Every row of an int8 weight's matmul in integers, as plain ops for the compiled layers
    and decode step to trace (`--quantized-decode int8`): the weights exact, the activations
    to ~15 bits of each row's max; a row's bits depend on the row alone at any row count
    (checked: a one-row graph, the dynamic-row graph and eager agree to the bit)."""
    q, row_scales = digits(x)
    return combine(torch._int_mm(q, w.qweight.t()), row_scales, w.scales_fp32, x.dtype)


ROW_FORMS = {CpuInt8SumsWeight.kind: {"int8_sums": int8_sums}}  # every row of these kinds
