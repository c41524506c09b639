"""Megatron-style sharding of a Llama-family state dict: q/k/v and gate/up split by output rows
(column-parallel), o and down by input columns (row-parallel, summed by one all-reduce each),
embedding and lm_head by vocabulary rows. Each expert of a mixture of experts
(`mlp.experts.N.*`, models/moe_checkpoint.py) is split like a dense MLP, over its own width; the
router is replicated. Weights are sharded in full precision before they
reach the model, so any later transform of a weight (quantisation) applies to the shard."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend_engine.errors import ModelLoadError
from backend_engine.quant.formats import is_quantized, narrow


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """What one rank of a tensor-parallel group holds."""

    rank: int
    size: int
    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's KV heads (one shared head when the model has fewer than ranks)
    kv_head_start: int
    head_dim: int
    intermediate_size: int  # this rank's share of the MLP
    vocab_size: int  # the full vocabulary
    vocab_per_rank: int  # embedding / lm_head rows per rank (the last rank's padded with zeros)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank


def head_counts(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of the whole model, from its config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


def working_sizes(config, limit: int = 16) -> list[int]:
    """Tensor-parallel sizes up to `limit` that this model's shapes allow."""
    return [n for n in range(1, limit + 1) if not _size_problem(config, n)]


def _size_problem(config, size: int) -> str | None:
    heads, kv_heads, _ = head_counts(config)
    if heads % size:
        return f"{heads} attention heads do not split evenly across {size} ranks"
    if kv_heads >= size and kv_heads % size:
        return f"{kv_heads} KV heads do not split evenly across {size} ranks"
    if kv_heads < size and size % kv_heads:
        return (f"{kv_heads} KV heads cannot be replicated evenly across {size} ranks "
                f"(the size must be a multiple of {kv_heads})")
    if config.intermediate_size % size:
        return f"the MLP width {config.intermediate_size} does not split evenly across {size} ranks"
    experts = getattr(config, "moe_intermediate_size", None)
    if experts and experts % size:
        return f"the experts' width {experts} does not split evenly across {size} ranks"
    return None


def check_tensor_parallel_size(config, size: int, model_name: str = "the model") -> None:
    """Refuse a size the model's head counts do not allow, saying why and what would work."""
    if size < 1:
        raise ModelLoadError(f"tensor_parallel_size must be at least 1, not {size}")
    problem = _size_problem(config, size)
    if problem:
        sizes = ", ".join(map(str, working_sizes(config)))
        raise ModelLoadError(f"tensor_parallel_size {size} does not fit {model_name}: {problem}; "
                             f"sizes that work: {sizes}")


def shard_layout(config, rank: int, size: int) -> ShardLayout:
    check_tensor_parallel_size(config, size)
    heads, kv_heads, head_dim = head_counts(config)
    if kv_heads >= size:
        local_kv, kv_start = kv_heads // size, rank * (kv_heads // size)
    else:  # fewer KV heads than ranks: each rank keeps the one its query heads read
        local_kv, kv_start = 1, rank // (size // kv_heads)
    vocab = config.vocab_size
    return ShardLayout(rank, size, heads // size, local_kv, kv_start, head_dim,
                       config.intermediate_size // size, vocab, -(-vocab // size))


def _rows(tensor, start: int, count: int):
    if is_quantized(tensor):  # a GGUF/AWQ/GPTQ weight, sharded as stored
        return narrow(tensor, 0, start, count)
    return tensor[start:start + count].clone()  # a copy, so the full tensor can be freed


def _columns(tensor, start: int, count: int):
    if is_quantized(tensor):
        return narrow(tensor, 1, start, count)
    return tensor[:, start:start + count].contiguous()


def _vocab_rows(tensor: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    if is_quantized(tensor):
        raise ModelLoadError("tensor parallelism needs the embedding and lm_head unquantised "
                             "(they are split by vocabulary rows and padded)")
    shard = _rows(tensor, layout.vocab_start, layout.vocab_per_rank)
    missing = layout.vocab_per_rank - shard.shape[0]
    if missing:
        shard = torch.cat([shard, shard.new_zeros(missing, *shard.shape[1:])])
    return shard


def shard_tensor(name: str, tensor: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """This rank's part of one weight, by its Hugging Face name; others are replicated."""
    d, i = layout.head_dim, layout.intermediate_size
    q_rows = (layout.rank * layout.num_heads * d, layout.num_heads * d)
    kv_rows = (layout.kv_head_start * d, layout.num_kv_heads * d)
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return _rows(tensor, *q_rows)
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return _rows(tensor, *kv_rows)
    if name.endswith("o_proj.weight"):
        return _columns(tensor, *q_rows)
    if ".experts." in name:  # an expert's own width, whatever the dense MLP's
        if name.endswith("down_proj.weight"):
            width = tensor.shape[1] // layout.size
            return _columns(tensor, layout.rank * width, width)
        width = tensor.shape[0] // layout.size
        return _rows(tensor, layout.rank * width, width)
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return _rows(tensor, layout.rank * i, i)
    if name.endswith("down_proj.weight"):
        return _columns(tensor, layout.rank * i, i)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _vocab_rows(tensor, layout)
    return tensor


def shard_state_dict(weights: dict[str, torch.Tensor], layout: ShardLayout
                     ) -> dict[str, torch.Tensor]:
    """The rank's shard of a full-precision state dict (the input is emptied as it goes)."""
    if layout.size == 1:
        return weights
    return {name: shard_tensor(name, weights.pop(name), layout) for name in list(weights)}
