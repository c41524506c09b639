"""Decode attention over paged KV, written to be compiled inside the decode step
(decode_step.py).

Written as plain indexing (`k_cache[block_tables]`), run eager, the gather would copy each row's
context out of the pool; compiled, Inductor fuses the block-table lookup into the score and
value reductions, so K and V are read once, in place, from their blocks. Every row is padded to
the step's longest context (masked), so a step's attention costs rows x longest context. A
sliding-window layer (`window` > 0) masks the positions before each row's window too; given
tables cut to the window (attention/window.py), it reads only the window's blocks.
"""

from __future__ import annotations

import torch


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                  scale: float, window: int = 0) -> torch.Tensor:
    """query [B, H, D]; caches [N, bs, KVH, D]; block_tables [B, nb]; context_lens [B];
    window: the positions each row's query sees, up to its own (0: all)."""
    batch, num_blocks = block_tables.shape
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    heads = query.shape[1]
    group = heads // kv_heads
    q = query.view(batch, kv_heads, group, 1, 1, head_dim).float()
    k = k_cache[block_tables].permute(0, 3, 1, 2, 4).unsqueeze(2)  # [B, KVH, 1, nb, bs, D]
    scores = (q * k.float()).sum(-1) * scale  # [B, KVH, G, nb, bs]
    positions = torch.arange(num_blocks * block_size, device=query.device).view(num_blocks, block_size)
    past = positions[None, None, None] >= context_lens.view(batch, 1, 1, 1, 1)
    if window:
        past |= positions[None, None, None] < (context_lens - window).view(batch, 1, 1, 1, 1)
    scores = scores.masked_fill(past, float("-inf")).view(batch, kv_heads, group, -1)
    probs = torch.softmax(scores, dim=-1).view(batch, kv_heads, group, num_blocks, block_size, 1)
    v = v_cache[block_tables].permute(0, 3, 1, 2, 4).unsqueeze(2)  # [B, KVH, 1, nb, bs, D]
    out = (probs * v.float()).sum((-3, -2))  # [B, KVH, G, D]
    return out.reshape(batch, heads, head_dim).to(query.dtype)
