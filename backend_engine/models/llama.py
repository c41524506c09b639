"""Llama-family decoder (Llama, SmolLM, Qwen2, Mistral) over paged KV caches: the reference.

Weights come from a Hugging Face state dict; q/k/v and gate/up are fused into one matmul each,
and every weight is laid out for the device by the `WeightPrep` the runner gives (quantised at
load when asked; accel/prepare.py). Under tensor parallelism the state dict is this rank's shard
(distributed/sharding.py): the model then holds its share of the heads and of the MLP, sums the
o and down projections over the ranks, and looks up / scores the vocabulary in parallel
(distributed/vocab.py).

`forward` is the reference path: every layer, eager, over every row of the step, each matmul
through one `Linear` (models/linear.py) and attention through the engine's backend. The
execution plan (accel/) runs the same layers faster — kinds of rows apart, compiled — and is
tested against this.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from backend_engine.attention.backend import AttentionBackend
from backend_engine.attention.metadata import AttentionMetadata
from backend_engine.distributed.group import SINGLE, TensorParallelGroup
from backend_engine.distributed.sharding import shard_layout
from backend_engine.distributed.vocab import embed_tokens, gather_logits
from backend_engine.errors import ModelLoadError
from backend_engine.models.layers import decoder_layer, input_half, output_half, rms_norm
from backend_engine.models.linear import REFERENCE, Linear
from backend_engine.models.rotary import RotaryEmbedding
from backend_engine.quant.formats import cat_rows, is_quantized

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class WeightPrep(Protocol):
    device: torch.device
    dtype: torch.dtype
    quantization: str | None

    def dense(self, t: torch.Tensor) -> torch.Tensor: ...
    def linear(self, w: Any, name: str) -> Any: ...
    def lm_head(self, w: Any) -> Any: ...
    def experts(self, pairs: list) -> Any: ...


class DecoderLayer:
    kind: int | None = None  # which of the step's cos/sin it takes (rotary_layer_types); None: all
    window = 0  # its sliding window (0: full attention)

    def __init__(self, weights: dict[str, Any], prefix: str, model: "LlamaModel",
                 prep: WeightPrep):
        self.model = model

        def w(name: str):
            key = prefix + name
            if key not in weights:
                raise ModelLoadError(f"weight {key} missing from the checkpoint")
            return weights[key]

        def fused(*names: str):
            return prep.linear(cat_rows([w(n) for n in names]), prefix + names[0])

        attn = "self_attn."
        self.qkv_weight = fused(attn + "q_proj.weight", attn + "k_proj.weight",
                                attn + "v_proj.weight")
        bias_keys = [prefix + attn + f"{p}_proj.bias" for p in "qkv"]
        self.qkv_bias = (prep.dense(torch.cat([weights[k] for k in bias_keys]))
                         if all(k in weights for k in bias_keys) else None)
        self.qk_norm = self.head_norms(w, prep)
        self.o_weight = fused(attn + "o_proj.weight")
        self.init_mlp(w, fused, prep)
        self.input_norm = prep.dense(w("input_layernorm.weight"))
        self.post_attn_norm = prep.dense(w("post_attention_layernorm.weight"))

    def init_mlp(self, w, fused, prep: WeightPrep) -> None:
        """The MLP's weights: gate/up fused, and down (moe.py puts experts here)."""
        self.gate_up_weight = fused("mlp.gate_proj.weight", "mlp.up_proj.weight")
        self.down_weight = fused("mlp.down_proj.weight")

    def head_norms(self, w, prep: WeightPrep) -> torch.Tensor | None:
        """The q and k heads' norms ([2, head_dim]); Llama has none (qwen3.py does)."""
        return None

    def weights(self) -> tuple:
        """(input norm, qkv weight, qkv bias, q/k head norms, o weight, post-attention norm,
        gate/up weight, down weight): what the compiled decode step takes per layer."""
        return (self.input_norm, self.qkv_weight, self.qkv_bias, self.qk_norm, self.o_weight,
                self.post_attn_norm, self.gate_up_weight, self.down_weight)

    def linear_weights(self) -> tuple:
        return self.qkv_weight, self.o_weight, self.gate_up_weight, self.down_weight

    def __call__(self, hidden, cos, sin, k_cache, v_cache, meta: AttentionMetadata,
                 linear: Linear):
        attn = self.attend(hidden, cos, sin, k_cache, v_cache, meta, linear)
        m = self.model
        return output_half(attn, hidden, self.o_weight, self.post_attn_norm,
                           self.gate_up_weight, self.down_weight, m.eps, linear,
                           m.tp.all_reduce)

    def attend(self, hidden, cos, sin, k_cache, v_cache, meta: AttentionMetadata,
               linear: Linear) -> torch.Tensor:
        """The input half, the K/V store and attention: [T, H, D], before the o projection."""
        m = self.model
        q, k, v = input_half(hidden, self.input_norm, self.qkv_weight, self.qkv_bias,
                             self.qk_norm, cos, sin, m.eps, m.num_heads, m.num_kv_heads,
                             m.head_dim, linear)
        m.attention.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return m.attention.forward(q, k_cache, v_cache, meta, m.scale)


class LlamaModel:
    layer_class = DecoderLayer  # a family's own layer (qwen3.py) subclasses it
    # the plan's compiled layers (accel/) trace this class's layers; a family whose layers
    # differ otherwise (gemma3.py) runs its prompt rows eager, each matmul the plan's Linear
    compiles = True
    # one layer as the compiled decode step runs it, over its layer's weights(); None: no step
    decode_layer = staticmethod(decoder_layer)
    norm_fn = staticmethod(rms_norm)  # the family's RMSNorm (the final norm's)
    rotary_layer_types: tuple[str, ...] = ()  # kinds of layer with rotary settings of their own

    @staticmethod
    def checkpoint_weights(weights: dict[str, Any], config) -> dict[str, Any]:
        """The checkpoint's tensors under the names this class reads (phi3.py renames)."""
        return weights

    def __init__(self, config, weights: dict[str, Any], attention: AttentionBackend,
                 max_positions: int, prep: WeightPrep, tp: TensorParallelGroup = SINGLE):
        """Under tensor parallelism (`tp` of more than one rank), `weights` is the rank's shard."""
        self.config = config
        self.tp = tp
        self.layout = shard_layout(config, tp.rank, tp.size)
        self.num_heads = self.layout.num_heads  # this rank's (all of them without parallelism)
        self.num_kv_heads = self.layout.num_kv_heads
        self.head_dim = self.layout.head_dim
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")
        self.scale = self.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.attention = attention
        self.dtype, self.device = prep.dtype, prep.device
        self.rotary = RotaryEmbedding(config, self.head_dim, max_positions, self.dtype,
                                      self.device, self.rotary_layer_types)
        self.embed = prep.dense(weights["model.embed_tokens.weight"])
        self.norm = prep.dense(weights["model.norm.weight"])
        tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in weights
        lm_head = weights["model.embed_tokens.weight"] if tied else weights["lm_head.weight"]
        if prep.quantization or is_quantized(lm_head):
            # the largest single matrix (49152 x 576 in SmolLM2), read whole at every step
            self.lm_head = prep.lm_head(lm_head)
        else:
            self.lm_head = self.embed if tied else prep.dense(lm_head)
        self.layers = [self.layer_class(weights, f"model.layers.{i}.", self, prep)
                       for i in range(self.num_layers)]

    def linear_weights(self) -> list:
        """Every layer's linear weights (qkv, o, gate_up, down, layer by layer)."""
        return [w for layer in self.layers for w in layer.linear_weights()]

    def layer_windows(self) -> list[int]:
        """Each layer's sliding window (0: full attention), for the KV cache groups."""
        return [0] * self.num_layers

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_tokens(input_ids, self.embed, self.layout, self.tp)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                meta: AttentionMetadata, linear: Linear = REFERENCE) -> torch.Tensor:
        """The final-normed hidden states of every row of the step (the reference path)."""
        cos, sin = self.rotary.cos_sin(positions)
        return self.run_layers(self.embed_tokens(input_ids), cos, sin, kv_caches, meta, linear)

    def run_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_caches: KVCaches, meta: AttentionMetadata, linear: Linear
                   ) -> torch.Tensor:
        """The layers one by one, eager, then the final norm."""
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            hidden = layer(hidden, cos, sin, k_cache, v_cache, meta, linear)
        return rms_norm(hidden, self.norm, self.eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, linear: Linear = REFERENCE
                       ) -> torch.Tensor | None:
        """Logits over the whole vocabulary; None on tensor-parallel ranks other than 0."""
        return gather_logits(linear(hidden, self.lm_head).float(), self.layout, self.tp)
