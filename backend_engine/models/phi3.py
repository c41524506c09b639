"""Phi-3: the Llama decoder with q/k/v and gate/up fused in the checkpoint (`self_attn.qkv_proj`,
q rows then k then v; `mlp.gate_up_proj`, gate rows then up). `checkpoint_weights` splits them
into the Llama names at load, before sharding and quantisation, so everything after is
llama.py's. No biases; rotary over the whole head (model_families.py refuses a partial one)."""

from __future__ import annotations

from typing import Any

from backend_engine.distributed.sharding import head_counts
from backend_engine.errors import ModelLoadError
from backend_engine.models.llama import LlamaModel
from backend_engine.quant.formats import narrow


def _split(weights: dict[str, Any], name: str, parts: dict[str, int]) -> None:
    fused = weights.pop(name)
    rows = fused.shape[0]
    if rows != sum(parts.values()):
        raise ModelLoadError(f"{name} has {rows} rows; the config asks for "
                             + " + ".join(f"{n} {p}" for p, n in parts.items()))
    start = 0
    prefix = name.rsplit(".", 2)[0]
    for part, count in parts.items():
        weights[f"{prefix}.{part}.weight"] = narrow(fused, 0, start, count)
        start += count


class Phi3Model(LlamaModel):
    @staticmethod
    def checkpoint_weights(weights: dict[str, Any], config) -> dict[str, Any]:
        heads, kv_heads, head_dim = head_counts(config)
        inter = config.intermediate_size
        for i in range(config.num_hidden_layers):
            layer = f"model.layers.{i}."
            for fused in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"):
                if layer + fused not in weights:
                    raise ModelLoadError(f"weight {layer + fused} missing from the checkpoint")
            _split(weights, layer + "self_attn.qkv_proj.weight",
                   {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim,
                    "v_proj": kv_heads * head_dim})
            _split(weights, layer + "mlp.gate_up_proj.weight",
                   {"gate_proj": inter, "up_proj": inter})
        return weights
