"""Attention over paged KV in plain torch: the CPU path and the reference for kernels.

Decode reads each sequence's blocks through its block table. Sequences are grouped by context
length once per step (decode_groups.py), so a group is gathered block by block into one batched
matmul with little padding, instead of every sequence being padded to the longest context of
the step; a group's gathered K/V is bounded in size, so it stays in cache between the gather
and the matmuls. A prefill chunk gathers its context's blocks (one index_select) and runs SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend_engine.attention.decode_groups import DecodeGroup, decode_groups
from backend_engine.attention.metadata import AttentionMetadata


class TorchAttention:
    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        kv_heads, head_dim = k_cache.shape[-2:]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        out = torch.empty_like(query)
        nd = meta.num_decode_tokens
        if nd:
            groups = meta.scratch.get("decode_groups")
            if groups is None:  # once per step, shared by every layer
                bytes_per_token = 2 * k_cache[0, 0].numel() * k_cache.element_size()
                groups = meta.scratch["decode_groups"] = decode_groups(
                    meta.decode_block_tables, meta.decode_context_lens, k_cache.shape[1],
                    bytes_per_token, query.device, query.dtype)
            for group in groups:
                self._decode(query[:nd], k_cache, v_cache, group, scale, out[:nd])
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            k = _gather(k_cache, chunk.block_table, chunk.context_len)
            v = _gather(v_cache, chunk.block_table, chunk.context_len)
            out[rows] = self._prefill(query[rows], k, v, scale)
        return out

    @staticmethod
    def _decode(query, k_cache, v_cache, group: DecodeGroup, scale: float, out) -> None:
        # q [B, H, D] of the group's rows; K/V [B, L, KVH, D] gathered by block; GQA through a
        # grouped view of the queries, so K/V are never repeated per query head
        q = query if group.rows is None else query.index_select(0, group.rows)
        batch, heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        k = k_cache[group.block_tables].view(batch, -1, kv_heads, head_dim)
        v = v_cache[group.block_tables].view(batch, -1, kv_heads, head_dim)
        qg = q.view(batch, kv_heads, heads // kv_heads, head_dim)
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).mul_(scale)  # [B, KVH, G, L]
        if group.bias is not None:
            scores += group.bias
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        o = torch.matmul(probs, v.permute(0, 2, 1, 3)).reshape(batch, heads, head_dim)
        if group.rows is None:
            out.copy_(o)
        else:
            out.index_copy_(0, group.rows, o)

    @staticmethod
    def _prefill(q, k, v, scale: float):
        # q [Q, H, D], k/v [L, KVH, D] with L >= Q: the chunk's queries are the last Q positions
        q_len, ctx_len = q.shape[0], k.shape[0]
        qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if q_len == ctx_len:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            offset = ctx_len - q_len
            rows = torch.arange(q_len, device=q.device).unsqueeze(1) + offset
            mask = torch.arange(ctx_len, device=q.device).unsqueeze(0) <= rows
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        return o.transpose(0, 1)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """A sequence's context K (or V) as [context_len, KVH, D], copied block by block."""
    kv_heads, head_dim = cache.shape[-2:]
    return cache.index_select(0, block_table).view(-1, kv_heads, head_dim)[:context_len]
