"""A decoder layer's row-wise math, split at attention: the input half (norm, qkv projection,
rotary) and the output half (o projection, residual, norm, gated MLP, residual).

Attention in between reads and writes the paged KV cache and sees which rows belong to which
sequence; these halves treat every row alike. The reference layers (llama.py) call them eager
with the tensor-parallel all-reduce; the compiled layers and decode step (accel/) trace the same
functions. Every matmul goes through `linear`, the one linear interface (linear.py).
`decoder_layer` is a whole layer around an `attend(q, k, v)` that stores K/V and attends: what
the compiled decode step runs per layer (a family whose layer differs gives its own, gemma3.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from backend_engine.models.linear import Linear
from backend_engine.models.rotary import RotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # one fused op (bit-identical to x * rsqrt(mean(x^2) + eps) * weight in fp32)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # bf16/fp16: normalise in fp32, round, then scale, in transformers' order
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def rms_norm_fp32_scale(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise and scale in fp32, then round to x's dtype (Gemma's order; weight in fp32)."""
    return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def input_half(hidden: torch.Tensor, norm: torch.Tensor, qkv_weight,
               qkv_bias: torch.Tensor | None, qk_norm: torch.Tensor | None, cos: torch.Tensor,
               sin: torch.Tensor, eps: float, heads: int, kv_heads: int, head_dim: int,
               linear: Linear, norm_fn: Callable = rms_norm):
    """The layer's input [T, hidden] → q [T, H, D], k [T, KVH, D], v [T, KVH, D].

    qk_norm: [2, D], the q and the k head's RMSNorm weights (Qwen3), applied to every head
    before the rotation; None where the family has none. norm_fn: the family's RMSNorm."""
    x = norm_fn(hidden, norm, eps)
    qkv = linear(x, qkv_weight, qkv_bias)
    qk, v = qkv.split([(heads + kv_heads) * head_dim, kv_heads * head_dim], dim=-1)
    qk = qk.view(-1, heads + kv_heads, head_dim)
    if qk_norm is not None:
        q, k = qk.split([heads, kv_heads], dim=1)
        qk = torch.cat([norm_fn(q, qk_norm[0], eps), norm_fn(k, qk_norm[1], eps)], dim=1)
    # q and k heads side by side: one rotation for both
    qk = RotaryEmbedding.rotate(qk, cos, sin)
    q, k = qk.split([heads, kv_heads], dim=1)
    return q, k, v.reshape(-1, kv_heads, head_dim)


def output_half(attn: torch.Tensor, residual: torch.Tensor, o_weight, norm: torch.Tensor,
                gate_up_weight, down_weight, eps: float, linear: Linear,
                all_reduce: Callable = _identity) -> torch.Tensor:
    """Attention's output [T, H, D] and the layer's input → the layer's output."""
    hidden = residual + all_reduce(linear(attn.reshape(attn.shape[0], -1), o_weight))
    x = rms_norm(hidden, norm, eps)
    return hidden + all_reduce(silu_mlp(x, gate_up_weight, down_weight, linear))


def decoder_layer(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: tuple,
                  attend: Callable, eps: float, heads: int, kv_heads: int, head_dim: int,
                  linear: Linear) -> torch.Tensor:
    """The Llama layer over `weights` (DecoderLayer.weights()); attend(q, k, v) → [T, H, D]."""
    (norm, qkv_weight, qkv_bias, qk_norm, o_weight, post_norm, gate_up_weight,
     down_weight) = weights
    q, k, v = input_half(hidden, norm, qkv_weight, qkv_bias, qk_norm, cos, sin, eps, heads,
                         kv_heads, head_dim, linear)
    return output_half(attend(q, k, v), hidden, o_weight, post_norm, gate_up_weight,
                       down_weight, eps, linear)


def silu_mlp(x: torch.Tensor, gate_up_weight, down_weight, linear: Linear) -> torch.Tensor:
    """The SiLU-gated MLP: down(silu(gate(x)) * up(x)), gate and up fused in one weight."""
    gate, up = linear(x, gate_up_weight).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down_weight)
