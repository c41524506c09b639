"""Mixture-of-experts pieces the MoE families share (qwen3_moe.py, mixtral.py): the top-k router,
the grouped expert MLP, and a decoder layer that runs them where the Llama layer runs its MLP.

Each expert is a SiLU-gated MLP whose gate/up (fused) and down weights are prepared like any
other linear weight (quantised at load when asked) and multiplied through the one Linear
interface. A step's rows are grouped by expert and each expert a row chose runs once, over all
its rows; the weighted results are added back in expert order, as transformers adds them.
Under tensor parallelism every rank routes the same (replicated) rows and holds a slice of every
expert's intermediate dimension, so the block's output is summed by one all-reduce, as a dense
MLP's is. The layers run eager with the plan's Linear (`compiles = False`); where the plan gives
the Linear an experts form (accel/cuda/fused_moe.py on CUDA), the experts run through it instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from backend_engine.attention.metadata import AttentionMetadata
from backend_engine.errors import ModelLoadError
from backend_engine.models.layers import rms_norm, silu_mlp
from backend_engine.models.linear import Linear
from backend_engine.models.llama import DecoderLayer, LlamaModel, WeightPrep
from backend_engine.models.moe_checkpoint import ExpertNames, canonical_experts

# per expert: (gate/up weight, down weight), as prep.linear made them and prep.experts laid out
Experts = Sequence[tuple[Any, Any]]


@dataclass(frozen=True, slots=True)
class Router:
    """Softmax over the experts' logits in fp32, the top k, renormalised over the k or not."""
    top_k: int
    renormalise: bool
    round_weights: bool  # the k weights rounded to the activations' dtype (qwen3_moe) or fp32

    def __call__(self, x: torch.Tensor, weight: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], weight [E, H] → (weights [T, k], experts [T, k])."""
        probs = torch.softmax(F.linear(x, weight), dim=-1, dtype=torch.float32)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            top = top / top.sum(dim=-1, keepdim=True)
        return (top.to(x.dtype) if self.round_weights else top), experts


def grouped_experts(x: torch.Tensor, top_weights: torch.Tensor, top_experts: torch.Tensor,
                    experts: Experts, linear: Linear) -> torch.Tensor:
    """Each row's Σ over its k experts of weight · expert(row): the (row, expert) pairs sorted
    by expert, each expert with pairs run once over its rows, the results scatter-added."""
    k = top_experts.shape[1]
    flat = top_experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    rows = order // k
    inputs = x[rows]
    weights = top_weights.flatten()[order, None]
    out = torch.zeros_like(x)
    start = 0
    for (gate_up, down), count in zip(experts, counts):
        if count:
            end = start + count
            y = silu_mlp(inputs[start:end], gate_up, down, linear) * weights[start:end]
            out.index_add_(0, rows[start:end], y.to(x.dtype))
            start = end
    return out


class SparseMoE:
    """One layer's router and experts."""

    def __init__(self, router_weight: torch.Tensor, experts: Experts, router: Router) -> None:
        self.router_weight = router_weight
        self.experts = experts
        self.router = router

    def __call__(self, x: torch.Tensor, linear: Linear) -> torch.Tensor:
        top_weights, top_experts = self.router(x, self.router_weight)
        grouped = linear.experts or grouped_experts  # the plan's experts form, if it has one
        return grouped(x, top_weights, top_experts, self.experts, linear)

    def linear_weights(self) -> list:
        """Every expert's gate/up and down weights, expert by expert."""
        return [w for pair in self.experts for w in pair]


class MoEDecoderLayer(DecoderLayer):
    """The Llama layer with a SparseMoE in place of the MLP, in the layers the model says."""

    def __init__(self, weights: dict[str, Any], prefix: str, model: "MoEModel",
                 prep: WeightPrep):
        self.index = int(prefix.rstrip(".").rsplit(".", 1)[1])
        super().__init__(weights, prefix, model, prep)

    def init_mlp(self, w, fused, prep: WeightPrep) -> None:
        m = self.model
        self.moe: SparseMoE | None = None
        if not m.sparse_layer(m.config, self.index):
            super().init_mlp(w, fused, prep)
            return
        experts = [(fused(f"mlp.experts.{e}.gate_proj.weight", f"mlp.experts.{e}.up_proj.weight"),
                    fused(f"mlp.experts.{e}.down_proj.weight")) for e in range(m.num_experts)]
        self.moe = SparseMoE(prep.dense(w("mlp.gate.weight")), prep.experts(experts), m.router)

    def linear_weights(self) -> tuple:
        if self.moe is None:
            return super().linear_weights()
        return (self.qkv_weight, self.o_weight, *self.moe.linear_weights())

    def __call__(self, hidden, cos, sin, k_cache, v_cache, meta: AttentionMetadata,
                 linear: Linear):
        if self.moe is None:
            return super().__call__(hidden, cos, sin, k_cache, v_cache, meta, linear)
        attn = self.attend(hidden, cos, sin, k_cache, v_cache, meta, linear)
        m = self.model
        hidden = hidden + m.tp.all_reduce(linear(attn.reshape(attn.shape[0], -1), self.o_weight))
        x = rms_norm(hidden, self.post_attn_norm, m.eps)
        return hidden + m.tp.all_reduce(self.moe(x, linear))


class MoEModel(LlamaModel):
    """A Llama-shaped decoder whose MLPs are SparseMoEs; a family says which layers are sparse,
    its experts' width, its checkpoint's names and its router."""
    layer_class = MoEDecoderLayer
    compiles = False  # the compiled pieces trace the Llama layer's dense MLP
    decode_layer = None
    expert_names = ExpertNames()
    expert_size_field = "intermediate_size"

    @staticmethod
    def sparse_layer(config, index: int) -> bool:
        return True

    @staticmethod
    def make_router(config) -> Router:
        """The family's router (mixtral.py, qwen3_moe.py)."""
        raise NotImplementedError

    @classmethod
    def checkpoint_weights(cls, weights: dict[str, Any], config) -> dict[str, Any]:
        inter = getattr(config, cls.expert_size_field)
        for i in range(config.num_hidden_layers):
            if cls.sparse_layer(config, i):
                canonical_experts(weights, f"model.layers.{i}.", config.num_experts,
                                  config.hidden_size, inter, cls.expert_names)
        return weights

    def __init__(self, config, weights: dict[str, Any], *args, **kwargs):
        sparse = any(self.sparse_layer(config, i) for i in range(config.num_hidden_layers))
        if sparse and not 0 < config.num_experts_per_tok <= config.num_experts:
            raise ModelLoadError(f"num_experts_per_tok={config.num_experts_per_tok} must be "
                                 f"between 1 and num_experts={config.num_experts}")
        self.num_experts = config.num_experts
        self.router = self.make_router(config)
        super().__init__(config, weights, *args, **kwargs)
