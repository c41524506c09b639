"""A mixture-of-experts checkpoint's expert weights under one set of names, whichever layout it
was saved in, each checked against the config's shapes:

    stacked (transformers 5 models' own state dict, both families):
        mlp.experts.gate_up_proj [E, 2I, H] (gate rows then up), mlp.experts.down_proj [E, H, I]
    per expert (what save_pretrained writes, and the published checkpoints):
        qwen3_moe  mlp.experts.N.{gate,up,down}_proj.weight
        mixtral    block_sparse_moe.experts.N.{w1,w3,w2}.weight (gate, up, down),
                   block_sparse_moe.gate.weight (the router)

become `mlp.gate.weight` [E, H] and `mlp.experts.N.{gate,up,down}_proj.weight`, the names the
model (moe.py) and tensor-parallel sharding (distributed/sharding.py) read. Runs before sharding
and quantisation; a tensor missing or of the wrong shape is a ModelLoadError naming it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend_engine.errors import ModelLoadError

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class ExpertNames:
    """A family's per-expert checkpoint names: the MoE block's and each projection's."""
    block: str = "mlp"
    projections: tuple[str, str, str] = PROJECTIONS  # gate, up, down


def _take(weights: dict[str, Any], name: str, shape: tuple[int, ...]) -> Any:
    if name not in weights:
        raise ModelLoadError(f"expert weight {name} missing from the checkpoint")
    tensor = weights.pop(name)
    if tuple(tensor.shape) != shape:
        raise ModelLoadError(f"expert weight {name} has shape {tuple(tensor.shape)}; the "
                             f"config asks for {shape}")
    return tensor


def canonical_experts(weights: dict[str, Any], prefix: str, num_experts: int, hidden: int,
                      inter: int, names: ExpertNames) -> None:
    """Rename (and unstack) one layer's router and experts in place; `prefix` names the layer."""
    out = prefix + "mlp."
    gate_up_name, down_name = out + "experts.gate_up_proj", out + "experts.down_proj"
    stacked = gate_up_name in weights or down_name in weights
    block = prefix + names.block + "."
    # the router: under the stacked layout's name, else under either per-expert one
    router = out if stacked or out + "gate.weight" in weights else block
    weights[out + "gate.weight"] = _take(weights, router + "gate.weight", (num_experts, hidden))
    if stacked:
        gate_up = _take(weights, gate_up_name, (num_experts, 2 * inter, hidden))
        down = _take(weights, down_name, (num_experts, hidden, inter))
        for e in range(num_experts):
            parts = (gate_up[e, :inter], gate_up[e, inter:], down[e])
            for proj, part in zip(PROJECTIONS, parts):
                weights[f"{out}experts.{e}.{proj}.weight"] = part
        return
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    for e in range(num_experts):
        for proj, stored, shape in zip(PROJECTIONS, names.projections, shapes):
            part = _take(weights, f"{block}experts.{e}.{stored}.weight", shape)
            weights[f"{out}experts.{e}.{proj}.weight"] = part
