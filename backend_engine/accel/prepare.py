"""From a checkpoint's weight to what the model computes with: quantise at load when asked, then
lay the weight out for its device's kernels. Applied per weight tensor, after q/k/v and gate/up
fusion and after any tensor-parallel sharding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from backend_engine.accel.cpu import kernels as cpu
from backend_engine.quant.formats import (Int4Weight, Int8Weight, LinearWeight, quantize_int4,
                                          quantize_int8, to_int8)

QUANTIZE_AT_LOAD = ("int8", "int4")


def quantize(w: LinearWeight, method: str | None, group_size: int, name: str) -> LinearWeight:
    """int8/int4 turn an fp weight into that format; already quantised weights stay as loaded."""
    if not isinstance(w, torch.Tensor) or method not in QUANTIZE_AT_LOAD:
        return w
    if method == "int8":
        return quantize_int8(w)
    return quantize_int4(w, group_size, name)


def prepare(w: LinearWeight, device: torch.device | str, dtype: torch.dtype) -> Any:
    """An fp weight in the compute dtype, or a quantised one in its device kernel's layout."""
    device = torch.device(device)
    if isinstance(w, torch.Tensor):
        return w.to(dtype=dtype, device=device).contiguous()
    if device.type == "cpu":
        return cpu.prepare_int8(w) if isinstance(w, Int8Weight) else cpu.prepare_int4(w)
    from backend_engine.accel.cuda import weights  # triton: only where a GPU runs the model

    return weights.prepare(w, device)


def prepare_lm_head(w: LinearWeight, method: str, group_size: int,
                    device: torch.device | str, dtype: torch.dtype) -> Any:
    """A quantised model's lm_head, prepared: `w8a8` int8 per channel with int8 activations
    per row (CPU; elsewhere int8 weight-only), `int8` weight-only per channel, or
    `int4` in groups of `group_size`; an lm_head stored in that format already stays as stored."""
    if method == "int4":
        if not isinstance(w, Int4Weight):
            w = quantize_int4(w if isinstance(w, torch.Tensor) else w.dequantize(), group_size,
                              "lm_head.weight")
        return prepare(w, device, dtype)
    w = to_int8(w)
    if method == "w8a8" and torch.device(device).type == "cpu":
        return cpu.prepare_w8a8(w)
    return prepare(w, device, dtype)


@dataclass(frozen=True, slots=True)
class WeightPrep:
    """How a model lays out its weights: the compute dtype and device, quantisation at load
    (`quantization` int8/int4, in groups of `group_size`), and the lm_head's format."""
    device: torch.device
    dtype: torch.dtype
    quantization: str | None = None
    group_size: int = 32
    lm_head_format: str = "w8a8"
    stack_experts: bool = False  # the plan's experts form is `triton` (accel/cuda/fused_moe.py)

    def dense(self, t: torch.Tensor) -> torch.Tensor:
        """Embeddings, norms and biases: the compute dtype on the model's device."""
        return t.to(dtype=self.dtype, device=self.device).contiguous()

    def linear(self, w: LinearWeight, name: str) -> Any:
        return prepare(quantize(w, self.quantization, self.group_size, name), self.device,
                       self.dtype)

    def lm_head(self, w: LinearWeight) -> Any:
        return prepare_lm_head(w, self.lm_head_format, self.group_size, self.device,
                               self.dtype)

    def experts(self, pairs: list) -> Any:
        """A mixture of experts' prepared (gate/up, down) pairs: stacked per projection for the
        grouped Triton kernels where the plan runs them (each pair a view into the stack)."""
        if not self.stack_experts:
            return pairs
        from backend_engine.accel.cuda import fused_moe  # triton: only where a GPU runs it

        return fused_moe.stack_experts(pairs)
