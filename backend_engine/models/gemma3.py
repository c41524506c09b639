"""Gemma 3 (text): the Llama decoder with these differences, each read from the checkpoint or
the config (`model_type` gemma3_text):

- every RMSNorm scales by `1 + w` (the checkpoint stores w; `checkpoint_weights` adds the 1),
  normalised and scaled in fp32, then rounded (`rms_norm_fp32_scale`);
- four norms per layer: before and after attention, before and after the MLP (the "after"
  ones normalise the block's output before the residual add);
- q/k head norms as in Qwen3; attention scaled by `query_pre_attn_scalar ** -0.5`;
- a GeGLU MLP (`gelu_pytorch_tanh` of the gate, times up);
- embeddings multiplied by sqrt(hidden_size), rounded to the compute dtype first;
- `layer_types`: sliding-window layers (each query sees the `sliding_window` positions up to
  its own, attention/backend.py) interleaved with global ones, each kind with its own rotary
  base (`rope_parameters[layer_type]`); the two kinds keep their KV blocks in KV cache groups
  of their own (kv_cache_groups.py), so each layer reads its group's metadata.

One layer's math is `gemma3_layer`, around an `attend(q, k, v)`: the eager layers call it with
the attention backend, the plan's compiled decode step (accel/decode_step.py) traces it with its
paged decode attention, each layer's window and rotary kind baked in. Prompt rows run eager
with the plan's Linear (`compiles = False`: the compiled layers trace the Llama layer).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from backend_engine.attention.metadata import AttentionMetadata
from backend_engine.errors import ModelLoadError
from backend_engine.models.layers import input_half, rms_norm_fp32_scale
from backend_engine.models.linear import Linear
from backend_engine.models.llama import LlamaModel, WeightPrep
from backend_engine.models.qwen3 import Qwen3DecoderLayer

LAYER_TYPES = ("full_attention", "sliding_attention")
_NORM = re.compile(r"norm\.weight$")


def _fp32(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(dtype=torch.float32, device=device).contiguous()


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def gemma3_layer(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: tuple,
                 attend: Callable, eps: float, heads: int, kv_heads: int, head_dim: int,
                 linear: Linear, all_reduce: Callable = _identity) -> torch.Tensor:
    """One Gemma 3 layer over `weights` (Gemma3DecoderLayer.weights()) and the layer's own
    cos/sin; attend(q, k, v) stores K/V and gives attention's output [T, H, D]."""
    (input_norm, qkv_weight, qk_norm, o_weight, post_attn_norm, pre_ff_norm, gate_up_weight,
     down_weight, post_ff_norm) = weights
    norm = rms_norm_fp32_scale
    q, k, v = input_half(hidden, input_norm, qkv_weight, None, qk_norm, cos, sin, eps, heads,
                         kv_heads, head_dim, linear, norm)
    attn = attend(q, k, v)
    attn = all_reduce(linear(attn.reshape(attn.shape[0], -1), o_weight))
    hidden = hidden + norm(attn, post_attn_norm, eps)
    gate, up = linear(norm(hidden, pre_ff_norm, eps), gate_up_weight).chunk(2, -1)
    mlp = all_reduce(linear(F.gelu(gate, approximate="tanh") * up, down_weight))
    return hidden + norm(mlp, post_ff_norm, eps)


class Gemma3DecoderLayer(Qwen3DecoderLayer):
    def __init__(self, weights: dict[str, Any], prefix: str, model: "Gemma3Model",
                 prep: WeightPrep):
        super().__init__(weights, prefix, model, prep)
        index = int(prefix.rstrip(".").rsplit(".", 1)[1])
        layer_type = model.config.layer_types[index]
        self.kind = LAYER_TYPES.index(layer_type)  # which of the step's cos/sin this layer takes
        self.window = model.config.sliding_window if layer_type == "sliding_attention" else 0
        norms = []
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            key = f"{prefix}{name}_layernorm.weight"
            if key not in weights:
                raise ModelLoadError(f"weight {key} missing from the checkpoint")
            norms.append(_fp32(weights[key], prep.device))
        self.input_norm, self.post_attn_norm, self.pre_ff_norm, self.post_ff_norm = norms

    def head_norms(self, w, prep: WeightPrep) -> torch.Tensor:
        return _fp32(self.head_norm_weights(w), prep.device)

    def weights(self) -> tuple:
        """(input norm, qkv weight, q/k head norms, o weight, post-attention norm,
        pre-feedforward norm, gate/up weight, down weight, post-feedforward norm)."""
        return (self.input_norm, self.qkv_weight, self.qk_norm, self.o_weight,
                self.post_attn_norm, self.pre_ff_norm, self.gate_up_weight, self.down_weight,
                self.post_ff_norm)

    def __call__(self, hidden, cos, sin, k_cache, v_cache, meta: AttentionMetadata,
                 linear: Linear):
        m = self.model

        def attend(q, k, v):
            m.attention.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            return m.attention.forward(q, k_cache, v_cache, meta, m.scale, self.window)

        return gemma3_layer(hidden, cos[:, self.kind], sin[:, self.kind], self.weights(),
                            attend, m.eps, m.num_heads, m.num_kv_heads, m.head_dim, linear,
                            m.tp.all_reduce)


class Gemma3Model(LlamaModel):
    layer_class = Gemma3DecoderLayer
    compiles = False
    decode_layer = staticmethod(gemma3_layer)
    norm_fn = staticmethod(rms_norm_fp32_scale)
    rotary_layer_types = LAYER_TYPES

    @staticmethod
    def checkpoint_weights(weights: dict[str, Any], config) -> dict[str, Any]:
        """Gemma's norms scale by 1 + w: add the 1 once here (in fp32)."""
        for name in [n for n in weights if _NORM.search(n)]:
            weights[name] = weights[name].float() + 1.0
        return weights

    def __init__(self, config, weights: dict[str, Any], *args, **kwargs):
        super().__init__(config, weights, *args, **kwargs)
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.norm = _fp32(weights["model.norm.weight"], self.device)
        # rounded to the compute dtype, as transformers does
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=self.dtype,
                                        device=self.device)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids) * self.embed_scale

    def layer_windows(self) -> list[int]:
        return [layer.window for layer in self.layers]

    def run_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_caches, meta: AttentionMetadata, linear: Linear) -> torch.Tensor:
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            hidden = layer(hidden, cos, sin, k_cache, v_cache, meta.for_layer(i), linear)
        return rms_norm_fp32_scale(hidden, self.norm, self.eps)
