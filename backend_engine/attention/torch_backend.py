"""Attention over paged KV in plain torch: the CPU path and the reference for kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend_engine.attention.metadata import AttentionMetadata


class TorchAttention:
    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        kv_heads, head_dim = k_cache.shape[-2:]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        kv_heads, head_dim = k_cache.shape[-2:]
        flat_k = k_cache.view(-1, kv_heads, head_dim)
        flat_v = v_cache.view(-1, kv_heads, head_dim)
        out = torch.empty_like(query)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(query[:nd], flat_k, flat_v, meta, scale)
        for chunk in meta.prefills:
            q = query[chunk.query_start: chunk.query_start + chunk.query_len]
            out[chunk.query_start: chunk.query_start + chunk.query_len] = self._prefill(
                q, flat_k[chunk.context_slots], flat_v[chunk.context_slots], scale)
        return out

    @staticmethod
    def _decode(q, flat_k, flat_v, meta: AttentionMetadata, scale: float):
        # q [B, H, D]; context gathered to [B, L, KVH, D]; GQA via a grouped view, no copies of K/V
        batch, heads, head_dim = q.shape
        k = flat_k[meta.decode_context_slots]
        v = flat_v[meta.decode_context_slots]
        kv_heads = k.shape[2]
        group = heads // kv_heads
        qg = q.view(batch, kv_heads, group, head_dim)
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale  # [B, KVH, G, L]
        scores = scores.masked_fill(~meta.decode_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, v.permute(0, 2, 1, 3)).reshape(batch, heads, head_dim)

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
            rows = torch.arange(q_len).unsqueeze(1) + offset
            mask = torch.arange(ctx_len).unsqueeze(0) <= rows
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        return o.transpose(0, 1)
