"""Qwen3 (dense): the Llama decoder with an RMSNorm over each query and key head, applied
before the rotation (`self_attn.q_norm`, `self_attn.k_norm`: one weight of head_dim each,
shared by the heads). No q/k/v biases; head_dim is the config's own, often not
hidden_size / num_attention_heads. Everything else is llama.py's."""

from __future__ import annotations

import torch

from backend_engine.errors import ModelLoadError
from backend_engine.models.llama import DecoderLayer, LlamaModel, WeightPrep


class Qwen3DecoderLayer(DecoderLayer):
    def head_norms(self, w, prep: WeightPrep) -> torch.Tensor:
        return prep.dense(self.head_norm_weights(w))

    def head_norm_weights(self, w) -> torch.Tensor:
        """[2, head_dim]: the q heads' norm weight, then the k heads'."""
        q_norm, k_norm = w("self_attn.q_norm.weight"), w("self_attn.k_norm.weight")
        if q_norm.shape != k_norm.shape or q_norm.shape != (self.model.head_dim,):
            raise ModelLoadError(f"q_norm/k_norm weights of shape {tuple(q_norm.shape)}/"
                                 f"{tuple(k_norm.shape)}; head_dim is {self.model.head_dim}")
        return torch.stack([q_norm, k_norm])


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer
