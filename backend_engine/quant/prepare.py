"""From a checkpoint's weight to what the model computes with: quantise at load when asked,
then lay the weight out for its device's kernels. Applied per weight tensor, after q/k/v and
gate/up fusion and after any tensor-parallel sharding."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from backend_engine.quant import cpu
from backend_engine.quant.formats import (Int4Weight, Int8Weight, LinearWeight, quantize_int4,
                                          quantize_int8, to_int8)

QUANTIZE_AT_LOAD = ("int8", "int4")
LM_HEAD_FORMATS = ("w8a8", "int8", "int4")  # --lm-head-quantization


def quantize(w: LinearWeight, method: str | None, group_size: int, name: str) -> LinearWeight:
    """int8/int4 turn an fp weight into that format; already quantised weights stay as loaded."""
    if not isinstance(w, torch.Tensor) or method not in QUANTIZE_AT_LOAD:
        return w
    if method == "int8":
        return quantize_int8(w)
    return quantize_int4(w, group_size, name)


def prepare_lm_head(w: LinearWeight, method: str, group_size: int,
                    device: torch.device | str, dtype: torch.dtype) -> Any:
    """A quantised model's lm_head, prepared: `w8a8` int8 per channel with int8 activations
    per row (CPU with oneDNN; elsewhere int8 weight-only), `int8` weight-only per channel, or
    `int4` in groups of `group_size`; an lm_head stored in that format already stays as stored."""
    if method not in LM_HEAD_FORMATS:
        raise ValueError(f"lm_head quantization must be one of {LM_HEAD_FORMATS}, not {method!r}")
    if method == "int4":
        if not isinstance(w, Int4Weight):
            w = quantize_int4(w if isinstance(w, torch.Tensor) else w.dequantize(), group_size,
                              "lm_head.weight")
        return prepare(w, device, dtype)
    w = to_int8(w)
    if method == "w8a8" and torch.device(device).type == "cpu" and cpu.w8a8_available():
        return cpu.prepare_w8a8(w)
    return prepare(w, device, dtype)


def prepare(w: LinearWeight, device: torch.device | str, dtype: torch.dtype,
            int8_sums: bool = False) -> Any:
    """An fp weight in the compute dtype, or a quantised one in its device kernel's layout;
    `int8_sums`: int8 weights on CPU multiply every row in integers (cpu_int8_gemm.py)."""
    device = torch.device(device)
    if isinstance(w, torch.Tensor):
        return w.to(dtype=dtype, device=device).contiguous()
    if device.type == "cpu":
        return cpu.prepare_int8(w, int8_sums) if isinstance(w, Int8Weight) else cpu.prepare_int4(w)
    from backend_engine.quant import cuda  # triton: only where a GPU runs the model

    return cuda.prepare(w, device)


def prompt_form(kind: str, name: str = "gemm") -> Callable | None:
    """The form prompt rows take for a prepared weight's kind, or None where there is none (CPU
    int8/int4 only): "gemm", dequantise and then a GEMM in fixed row tiles, or int4's compiled
    template where one is attached (quant/cpu_gemm.py); "int8", integer sums
    (quant/cpu_int8_gemm.py)."""
    if kind not in cpu.FORMS:
        return None
    from backend_engine.quant import cpu_gemm

    if kind == cpu.CpuInt4Weight.kind and not cpu_gemm.int4_layout_checked():
        return None
    if name == "int8":
        from backend_engine.quant import cpu_int8_gemm

        return cpu_int8_gemm.FORMS.get(kind)
    return cpu_gemm.FORMS.get(kind)


def forms(kind: str) -> dict[str, Callable]:
    """The matmul forms for a prepared quantised weight's kind; the first is the default."""
    if kind in cpu.FORMS:
        return cpu.FORMS[kind]
    if kind == cpu.CpuInt8SumsWeight.kind:
        from backend_engine.quant import cpu_int8_gemm

        return cpu_int8_gemm.ROW_FORMS[kind]
    from backend_engine.quant import cuda

    return cuda.FORMS[kind]
