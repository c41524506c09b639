"""A decoder layer's row-wise math, split at attention: the input half (norm, qkv projection,
rotary) and the output half (o projection, residual, norm, gated MLP, residual).

Attention in between reads and writes the paged KV cache and sees which rows belong to which
sequence; these halves treat every row alike. Eager layers (llama.py) call them with the
model's `RowAwareLinear` and tensor-parallel all-reduce; compiled layers (compiled_layers.py)
with `traced_linear`, which is what RowAwareLinear does for quantised CPU weights. A quantised
model's prompt rows may run both with a `prompt_linear` instead (LlamaModel.prompt_gemm).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from backend_engine.models.rotary import RotaryEmbedding
from backend_engine.quant.prepare import forms as quant_forms
from backend_engine.quant.prepare import prompt_form


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # one fused op (bit-identical to x * rsqrt(mean(x^2) + eps) * weight in fp32)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # bf16/fp16: normalise in fp32, round, then scale, in transformers' order
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def traced_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or a quantised weight's default kernel (the only one on CPU)."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    y = next(iter(quant_forms(weight.kind).values()))(x.reshape(-1, x.shape[-1]), weight)
    return y if bias is None else y + bias


@functools.cache
def prompt_linear(form: str = "gemm") -> Callable:
    """What prompt rows run: a quantised weight's prompt form `form` ("gemm": dequantise, then
    a GEMM in fixed row tiles, or int4's template; "int8": integer sums), else as
    `traced_linear`. One function per form, since compiled layers are kept per linear."""
    def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        matmul = None if isinstance(weight, torch.Tensor) else prompt_form(weight.kind, form)
        if matmul is None:
            return traced_linear(x, weight, bias)
        y = matmul(x.reshape(-1, x.shape[-1]), weight)
        return y if bias is None else y + bias
    return linear


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def input_half(hidden: torch.Tensor, norm: torch.Tensor, qkv_weight,
               qkv_bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float,
               heads: int, kv_heads: int, head_dim: int, linear: Callable = traced_linear):
    """The layer's input [T, hidden] → q [T, H, D], k [T, KVH, D], v [T, KVH, D]."""
    x = rms_norm(hidden, norm, eps)
    qkv = linear(x, qkv_weight, qkv_bias)
    qk, v = qkv.split([(heads + kv_heads) * head_dim, kv_heads * head_dim], dim=-1)
    # q and k heads side by side: one rotation for both
    qk = RotaryEmbedding.rotate(qk.view(-1, heads + kv_heads, head_dim), cos, sin)
    q, k = qk.split([heads, kv_heads], dim=1)
    return q, k, v.reshape(-1, kv_heads, head_dim)


def output_half(attn: torch.Tensor, residual: torch.Tensor, o_weight, norm: torch.Tensor,
                gate_up_weight, down_weight, eps: float, linear: Callable = traced_linear,
                all_reduce: Callable = _identity) -> torch.Tensor:
    """Attention's output [T, H, D] and the layer's input → the layer's output."""
    hidden = residual + all_reduce(linear(attn.reshape(attn.shape[0], -1), o_weight))
    x = rms_norm(hidden, norm, eps)
    gate, up = linear(x, gate_up_weight).chunk(2, dim=-1)
    return hidden + all_reduce(linear(F.silu(gate) * up, down_weight))
