"""Quantised weights on a GPU: the canonical layouts as stored (the Triton kernels read them
directly), scales in fp32, and the `triton` form over them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from backend_engine.accel.cuda.quant_matmul import int4_matmul, int8_matmul
from backend_engine.quant.formats import Int4Weight, Int8Weight


@dataclass(slots=True, eq=False)
class TritonInt8Weight:
    kind: ClassVar[str] = "int8_triton"
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # fp32 [N]

    shape = property(lambda self: tuple(self.qweight.shape))
    device = property(lambda self: self.qweight.device)
    nbytes = property(lambda self: self.qweight.nbytes + self.scales.nbytes)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return Int8Weight(self.qweight, self.scales).dequantize(dtype)


@dataclass(slots=True, eq=False)
class TritonInt4Weight:
    kind: ClassVar[str] = "int4_triton"
    weight: Int4Weight  # on the device, scales and mins in fp32

    shape = property(lambda self: self.weight.shape)
    device = property(lambda self: self.weight.qweight.device)
    nbytes = property(lambda self: self.weight.nbytes)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.dequantize(dtype)


def prepare(w: Int8Weight | Int4Weight, device: torch.device | str):
    def move(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return t.to(device=device, dtype=dtype or t.dtype).contiguous()

    if isinstance(w, Int8Weight):
        return TritonInt8Weight(move(w.qweight), move(w.scales, torch.float32))
    perm = move(w.perm) if w.perm is not None else None
    return TritonInt4Weight(Int4Weight(move(w.qweight), move(w.scales, torch.float32),
                                       move(w.mins, torch.float32), w.group_size, perm))


def int8_mm(x: torch.Tensor, w: TritonInt8Weight) -> torch.Tensor:
    return int8_matmul(x, w.qweight, w.scales)


def int4_mm(x: torch.Tensor, w: TritonInt4Weight) -> torch.Tensor:
    q = w.weight
    if q.perm is not None:
        x = x.index_select(1, q.perm)
    return int4_matmul(x, q.qweight, q.scales, q.mins, q.group_size)

