"""Mixtral: the Llama decoder with a sparse mixture of experts in every layer's MLP (moe.py).
The router softmaxes over all experts' logits in fp32, keeps the top `num_experts_per_tok` and
renormalises them over those k (a softmax over the k logits), weights kept in fp32. Each expert
is `intermediate_size` wide; the checkpoint stores them per expert as
`block_sparse_moe.experts.N.w1/w3/w2` (gate, up, down) or stacked (moe_checkpoint.py).
`router_jitter_noise` only acts in training, so inference reads past it."""

from __future__ import annotations

from backend_engine.models.moe import MoEModel, Router
from backend_engine.models.moe_checkpoint import ExpertNames


class MixtralModel(MoEModel):
    expert_names = ExpertNames("block_sparse_moe", ("w1", "w3", "w2"))

    @staticmethod
    def make_router(config) -> Router:
        return Router(config.num_experts_per_tok, renormalise=True, round_weights=False)
