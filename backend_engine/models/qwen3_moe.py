"""Qwen3 MoE: Qwen3's attention (an RMSNorm over each q and k head, qwen3.py) with a sparse
mixture of experts as the MLP (moe.py) in every `decoder_sparse_step`-th layer not listed in
`mlp_only_layers`; the other layers keep a dense MLP of `intermediate_size`. Experts are
`moe_intermediate_size` wide. The router softmaxes over all experts' logits in fp32 and keeps
the top `num_experts_per_tok`, renormalised over those k when `norm_topk_prob`, then rounds the
weights to the activations' dtype. No shared expert."""

from __future__ import annotations

from backend_engine.models.moe import MoEDecoderLayer, MoEModel, Router
from backend_engine.models.qwen3 import Qwen3DecoderLayer


class Qwen3MoeDecoderLayer(MoEDecoderLayer, Qwen3DecoderLayer):
    """The MoE layer (its MLP) with Qwen3's q/k head norms."""


class Qwen3MoeModel(MoEModel):
    layer_class = Qwen3MoeDecoderLayer
    expert_size_field = "moe_intermediate_size"

    @staticmethod
    def sparse_layer(config, index: int) -> bool:
        return (config.num_experts > 0 and index not in (config.mlp_only_layers or ())
                and (index + 1) % config.decoder_sparse_step == 0)

    @staticmethod
    def make_router(config) -> Router:
        return Router(config.num_experts_per_tok, renormalise=bool(config.norm_topk_prob),
                      round_weights=True)
