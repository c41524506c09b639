"""Quantised weights laid out for torch's CPU weight-only kernels, and the `kernel` and `w8a8`
forms over them (accel/plan.py says which rows take which).

- int8: `torch._weight_int8pack_mm(x, int8 [N, K], scales [N])` (per-channel, oneDNN/ATen
  vectorised), which needs x and the scales in one dtype.
- w8a8 (the lm_head of a quantised model): int8 weights and int8 activations, each row
  quantised on the fly by its own max |x| (symmetric, in [-127, 127]), multiplied in integers
  and rescaled per row and channel: what llama.cpp does for its Q8_0 output tensor. The sums
  come from oneDNN's VNNI kernel (`onednn.qlinear_pointwise`, the rows as uint8 around 128)
  where the CPU has int8 dot products, else from `kvgate::int8_gemm` (native.py: our AVX2
  kernel, or `torch._int_mm`). Integer sums are exact, so a row's result depends neither on its
  batch nor on which of them ran.
- int4: `aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)` over
  `aten._convert_weight_to_int4pack_for_cpu`'s blocked layout. Its dequantisation is
  w = (q - 8) * scale + zero, so our min becomes zero = min + 8 * scale; it packs N in tiles
  of 16, so other row counts are padded with zero rows.

Each kernel runs in bfloat16 (with fp32 activations they ran 5-40x slower), so an fp32 model's
activations are rounded to bf16 at the matmul and its output cast back. Each gives a row the same
bits whatever the batch around it, so greedy tokens do not change with batching, chunking or
preemption.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from backend_engine.accel.cpu import native
from backend_engine.accel.plan import device_class
from backend_engine.quant.formats import Int4Weight, Int8Weight

aten = torch.ops.aten
KERNEL_DTYPE = torch.bfloat16
_N_TILE = 16  # _convert_weight_to_int4pack_for_cpu needs N % 16 == 0
_ACT_MAX, _ACT_ZERO = 127, 128  # w8a8: a row's max |x| maps to +-127, around uint8's 128


@dataclass(slots=True, eq=False, weakref_slot=True)
class CpuInt8Weight:
    kind: ClassVar[str] = "int8_cpu"
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # bf16 [N]
    scales_fp32: torch.Tensor  # fp32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes + self.scales_fp32.nbytes

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scales_fp32[:, None]).to(dtype)


@dataclass(slots=True, eq=False)
class CpuW8A8Weight:
    kind: ClassVar[str] = "w8a8_cpu"
    weight: torch.Tensor  # int8 [N, K], or oneDNN's blocked layout of it (an mkldnn tensor)
    scales: torch.Tensor  # fp32 [N], applied after the integer sums (see w8a8_mm)
    onednn: bool  # whether `weight` is oneDNN's (VNNI) or plain int8 for kvgate::int8_gemm

    @property
    def shape(self) -> tuple[int, int]:
        n = self.scales.shape[0]
        return n, (self.weight.shape[0] if self.onednn else self.weight.shape[1])

    @property
    def nbytes(self) -> int:
        n, k = self.shape
        return n * k + self.scales.nbytes

    @property
    def device(self) -> torch.device:
        return self.scales.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact: the integer sums over the identity are the int8 weights."""
        eye = torch.eye(self.shape[1], dtype=torch.int8)
        return (_w8a8_sums(eye, self).t() * self.scales[:, None]).to(dtype)


@dataclass(slots=True, eq=False, weakref_slot=True)
class CpuInt4Weight:
    kind: ClassVar[str] = "int4_cpu"
    packed: torch.Tensor  # uint8, torch's blocked int4 layout for [N_padded, K]
    scales_and_zeros: torch.Tensor  # bf16 [K // group_size, N_padded, 2]
    group_size: int
    out_features: int  # N before padding
    perm: torch.Tensor | None  # input-channel order of the groups (GPTQ act-order)
    int8_scales: torch.Tensor  # fp32 [N_padded]: max |w| / 127 per channel (cpu_int8_gemm.py)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.packed.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes + self.int8_scales.nbytes + (
            self.perm.nbytes if self.perm is not None else 0)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact: the kernel itself applied to the identity."""
        k = self.shape[1]
        eye = torch.eye(k, dtype=KERNEL_DTYPE)
        grouped = aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size,
                                                   self.scales_and_zeros)
        grouped = grouped[:, :self.out_features].t().float()
        if self.perm is None:
            return grouped.to(dtype)
        w = torch.empty_like(grouped)
        w[:, self.perm] = grouped
        return w.to(dtype)


def prepare_int8(w: Int8Weight) -> CpuInt8Weight:
    scales = w.scales.float().contiguous()
    return CpuInt8Weight(w.qweight.contiguous(), scales.to(KERNEL_DTYPE), scales)


def _has_int8_dot_products() -> bool:
    """oneDNN's quantised matmul is built into this torch and the CPU's class has VNNI (the
    u8 x s8 pairs of oneDNN's kernel saturate without it; native.py)."""
    return device_class("cpu") in ("cpu-amx", "cpu-avx512") and (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack"))


def prepare_w8a8(w: Int8Weight) -> CpuW8A8Weight:
    scales = w.scales.float().contiguous()
    if _has_int8_dot_products():
        # laid out for one row (a decode step's lm_head); as fast as any layout at 16-64 rows
        packed = torch.ops.onednn.qlinear_prepack(w.qweight.contiguous(), [1, w.shape[1]])
        return CpuW8A8Weight(packed, scales, onednn=True)
    return CpuW8A8Weight(w.qweight.contiguous(), scales, onednn=False)


def prepare_int4(w: Int4Weight) -> CpuInt4Weight:
    n, k = w.shape
    pad = -n % _N_TILE
    q = w.values().to(torch.int32)
    scales, zeros = w.scales.float(), w.mins.float() + 8.0 * w.scales.float()
    if pad:
        q = torch.cat([q, q.new_full((pad, k), 8)])
        scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
        zeros = torch.cat([zeros, zeros.new_zeros(pad, zeros.shape[1])])
    packed = aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
    # each channel's largest |w| as the kernel dequantises it (from the bf16 scales and zeros)
    s, z = (part.float().t()[..., None] for part in sz.unbind(-1))  # [N_padded, groups, 1]
    w_max = ((q.view(n + pad, -1, w.group_size) - 8) * s + z).abs().amax(dim=(1, 2))
    return CpuInt4Weight(packed, sz, w.group_size, n, w.perm, w_max.clamp_min(1e-30) / 127)


def _to_kernel(x: torch.Tensor) -> torch.Tensor:
    # a check in Python is cheaper than a no-op dispatch, and this runs 4x per layer per step
    x = x if x.dtype == KERNEL_DTYPE else x.to(KERNEL_DTYPE)
    return x if x.is_contiguous() else x.contiguous()


def _from_kernel(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return y if dtype == KERNEL_DTYPE else y.to(dtype)


def int8_mm(x: torch.Tensor, w: CpuInt8Weight) -> torch.Tensor:
    return _from_kernel(torch._weight_int8pack_mm(_to_kernel(x), w.qweight, w.scales), x.dtype)


def _w8a8_sums(qx: torch.Tensor, w: CpuW8A8Weight) -> torch.Tensor:
    """The integer sums qx . q (qx int8 [M, K] in [-127, 127]) as fp32. oneDNN is given unit
    scales: its sums are exact in int32 and their conversion a function of the sum alone; with
    the real scales in the kernel a row's result depended on its batch on an AMX CPU (oneDNN's
    small-matrix kernel applied them in another order)."""
    if not w.onednn:
        return native.int8_gemm(qx, w.weight).float()
    n = w.scales.shape[0]
    return torch.ops.onednn.qlinear_pointwise(
        (qx.to(torch.int16) + _ACT_ZERO).to(torch.uint8), 1.0, _ACT_ZERO, w.weight,
        _unit_scales(n), _zero_points(n), None, 1.0, 0, torch.float32, "none", [], "")


@functools.lru_cache(maxsize=8)
def _unit_scales(n: int) -> torch.Tensor:
    return torch.ones(n)


@functools.lru_cache(maxsize=8)
def _zero_points(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32)


def w8a8_mm(x: torch.Tensor, w: CpuW8A8Weight) -> torch.Tensor:
    xf = x.float()
    row_max = xf.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30)  # 127 / max stays finite
    qx = (xf * (_ACT_MAX / row_max)).round_().to(torch.int8)
    y = _w8a8_sums(qx, w).mul_(w.scales)
    return y.mul_(row_max / _ACT_MAX).to(x.dtype)


def int4_mm(x: torch.Tensor, w: CpuInt4Weight) -> torch.Tensor:
    dtype = x.dtype
    if w.perm is not None:
        x = x.index_select(1, w.perm)
    y = aten._weight_int4pack_mm_for_cpu(_to_kernel(x), w.packed, w.group_size,
                                         w.scales_and_zeros)
    if y.shape[1] != w.out_features:
        y = y[:, :w.out_features].contiguous()
    return _from_kernel(y, dtype)

