"""Vocabulary-parallel embedding and lm_head: each rank holds a slice of the vocabulary's rows.
A lookup embeds the ids in the rank's slice, zeroes the rest and sums over the ranks; the
logits of each rank's slice are gathered on rank 0, which samples (the sampler needs the whole
distribution for penalties, top-p, logprobs and speculative verification)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend_engine.distributed.group import TensorParallelGroup
from backend_engine.distributed.sharding import ShardLayout


def embed_tokens(input_ids: torch.Tensor, weight: torch.Tensor, layout: ShardLayout,
                 tp: TensorParallelGroup) -> torch.Tensor:
    if tp.size == 1:
        return F.embedding(input_ids, weight)
    local = input_ids - layout.vocab_start
    outside = (local < 0) | (local >= layout.vocab_per_rank)
    hidden = F.embedding(local.masked_fill(outside, 0), weight)
    hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
    return tp.all_reduce(hidden)


def gather_logits(local: torch.Tensor, layout: ShardLayout,
                  tp: TensorParallelGroup) -> torch.Tensor | None:
    """[rows, vocab] logits on rank 0 (the padding of the last slice cut off); None elsewhere."""
    if tp.size == 1:
        return local
    shards = tp.gather(local.contiguous())
    if shards is None:
        return None
    return torch.cat(shards, dim=-1)[:, :layout.vocab_size]
