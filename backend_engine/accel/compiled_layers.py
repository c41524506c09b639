"""The row-wise work of the decoder layers, compiled (Inductor's C++ on CPU).

Between two attentions a layer runs ~60 small ops (norms, the rotary rotation, splits, SiLU,
residual adds, dtype casts) around four matmuls; eager, each op costs a dispatch and, with two
or more threads, an OpenMP fork and join, which at a few rows is most of the step. Compiled,
one call per layer runs them fused, and the matmuls stay the row kind's Linear.

The boundary is attention: a compiled call runs layer i's output half (o projection, residual,
norm, MLP) and layer i+1's input half (norm, qkv, rotary) and returns that layer's q, k, v;
storing K/V and attention (paged, decode and prefill rows alike) stay outside. So every row of a
kind goes through the same code, whatever the step holds.

One compiled function serves every layer (weights are inputs, so the layers share the graph)
and every engine of a process with the same model shape, dtypes and Linear. The row count is
dynamic; `warm_up` compiles at start-up for one row and for several.
"""

from __future__ import annotations

import threading

import torch

from backend_engine.accel.compile import Compiled
from backend_engine.attention.metadata import AttentionMetadata
from backend_engine.models.layers import input_half, output_half, rms_norm
from backend_engine.models.linear import Linear


def _between(attn, residual, o_weight, post_norm, gate_up_weight, down_weight,
             next_norm, next_qkv_weight, next_qkv_bias, next_qk_norm, cos, sin,
             eps: float, heads: int, kv_heads: int, head_dim: int, linear: Linear):
    hidden = output_half(attn, residual, o_weight, post_norm, gate_up_weight, down_weight, eps,
                         linear)
    q, k, v = input_half(hidden, next_norm, next_qkv_weight, next_qkv_bias, next_qk_norm, cos,
                         sin, eps, heads, kv_heads, head_dim, linear)
    return hidden, q, k, v


def _last(attn, residual, o_weight, post_norm, gate_up_weight, down_weight, final_norm,
          eps: float, linear: Linear):
    hidden = output_half(attn, residual, o_weight, post_norm, gate_up_weight, down_weight, eps,
                         linear)
    return rms_norm(hidden, final_norm, eps)


def _bound(fn, linear: Linear):
    def entry(*args):
        return fn(*args, linear=linear)
    entry.__name__ = fn.__name__
    return entry


class CompiledLayers:
    """The three compiled entry points (the first input half; between two attentions; the last
    output half and the final norm) for one model shape and one Linear; eager where they cannot
    be compiled here (`failed`)."""

    def __init__(self, linear: Linear) -> None:
        self.linear = linear
        self.first = Compiled(_bound(input_half, linear), "compiled layers")
        self.between = Compiled(_bound(_between, linear), "compiled layers")
        self.last = Compiled(_bound(_last, linear), "compiled layers")

    @property
    def failed(self) -> bool:
        return self.first.failed or self.between.failed or self.last.failed

    def run(self, model, hidden, cos, sin, kv_caches, meta: AttentionMetadata | None,
            attn: torch.Tensor | None = None) -> torch.Tensor:
        """The model's layers over these rows, then the final norm; attention (and the K/V
        stores) between the compiled calls, eager. `attn` instead of caches: the warm-up, which
        touches no cache."""
        shape = (model.eps, model.num_heads, model.num_kv_heads, model.head_dim)
        first = model.layers[0]
        q, k, v = self.first(hidden, first.input_norm, first.qkv_weight, first.qkv_bias,
                             first.qk_norm, cos, sin, *shape, rows_at=(0, 5, 6))
        caches = kv_caches or [None] * model.num_layers
        for i, (layer, cache) in enumerate(zip(model.layers, caches)):
            if cache is not None:
                model.attention.store_kv(k, v, *cache, meta.slot_mapping)
                # contiguous, as at warm-up (strides are guarded: another layout recompiles)
                attn = model.attention.forward(q, *cache, meta, model.scale).contiguous()
            out = (attn, hidden, layer.o_weight, layer.post_attn_norm, layer.gate_up_weight,
                   layer.down_weight)
            if i + 1 == model.num_layers:
                return self.last(*out, model.norm, model.eps, rows_at=(0, 1))
            nxt = model.layers[i + 1]
            hidden, q, k, v = self.between(*out, nxt.input_norm, nxt.qkv_weight,
                                           nxt.qkv_bias, nxt.qk_norm, cos, sin, *shape,
                                           rows_at=(0, 1, 10, 11))

    def warm_up(self, model) -> bool:
        """Compile now (start-up), for one row and for several. True if it works here."""
        hidden_size = model.embed.shape[1]
        with torch.inference_mode():  # inference tensors, as in the engine's steps
            for rows in (1, 3):
                hidden = torch.zeros(rows, hidden_size, dtype=model.dtype, device=model.device)
                attn = torch.zeros(rows, model.num_heads, model.head_dim, dtype=model.dtype,
                                   device=model.device)
                cos, sin = model.rotary.cos_sin(torch.zeros(rows, dtype=torch.long,
                                                            device=model.device))
                self.run(model, hidden, cos, sin, (), None, attn)
        return not self.failed


_lock = threading.Lock()
_shared: dict[tuple, CompiledLayers] = {}


def compiled_layers(model, linear: Linear) -> CompiledLayers:
    """One CompiledLayers per model shape, dtypes and Linear in a process (engines share it)."""
    layer = model.layers[0]
    key = (model.dtype, model.eps, model.num_heads, model.num_kv_heads, model.head_dim,
           layer.qkv_bias is not None, layer.qk_norm is not None, linear,
           *((type(w), tuple(w.shape), getattr(w, "group_size", None))
             for w in layer.linear_weights()))
    with _lock:
        if key not in _shared:
            _shared[key] = CompiledLayers(linear)
        return _shared[key]
