"""Attention over paged KV in plain torch: the CPU path and the reference for kernels.

Decode reads each sequence's blocks through its block table. Sequences are grouped by context
length once per step (decode_groups.py), so a group is gathered block by block into one batched
matmul with little padding, instead of every sequence being padded to the longest context of
the step; a group's gathered K/V is small (a few MB), so it is still in cache when the two
matmuls read it (small groups ran several times faster per byte than large ones). The compiled
decode step (accel/decode_step.py) reads decode K/V in place instead, where the plan compiles.
A prefill chunk gathers its context's blocks (one index_select) and runs SDPA. A sliding-window
layer reads only the blocks its window covers (window.py), decode and prefill rows alike.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from backend_engine.attention.decode_groups import DecodeGroup, decode_groups
from backend_engine.attention.metadata import AttentionMetadata
from backend_engine.attention.window import decode_window, prefill_window_start


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V [T, KVH, D] into its slot of the paged caches [N, bs, KVH, D]."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value)


# store_kv as one opaque op that declares what it writes, for the compiled decode step
# (accel/decode_step.py). Traced as plain index_copy_, a pool that several layers of the graph
# write (KV cache groups share pools) is functionalised into one new pool per write, and Inductor
# writes only the last one in place: every earlier store copies the whole pool. An op that
# mutates its arguments is kept as one in-place call on the pool, however many layers write it.
store_kv_op = torch.library.custom_op("kvgate::store_kv", store_kv,
                                      mutates_args=("k_cache", "v_cache"))


class TorchAttention:
    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int = 0):
        # dense, whatever the strides of query (a view into the qkv projection)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        nd = meta.num_decode_tokens
        block_size = k_cache.shape[1]
        if nd:
            groups = meta.scratch.get(("decode_groups", window))
            if groups is None:  # once per step and window, shared by the layers
                bytes_per_token = 2 * k_cache[0, 0].numel() * k_cache.element_size()
                tables, lens = meta.decode_block_tables, meta.decode_context_lens
                if window:
                    tables, lens = decode_window(tables, lens, window, block_size)
                groups = meta.scratch[("decode_groups", window)] = decode_groups(
                    tables, lens, block_size, bytes_per_token, query.device, query.dtype)
            for group in groups:
                self._decode(query[:nd], k_cache, v_cache, group, scale, window, out[:nd])
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            first = (prefill_window_start(chunk.context_len, chunk.query_len, window,
                                          block_size) if window else 0)
            table, context_len = chunk.block_table[first:], chunk.context_len - first * block_size
            k = _gather(k_cache, table, context_len)
            v = _gather(v_cache, table, context_len)
            out[rows] = self._prefill(query[rows], k, v, scale, window)
        return out

    @staticmethod
    def _decode(query, k_cache, v_cache, group: DecodeGroup, scale: float, window: int,
                out) -> None:
        # K/V of the group gathered by block: [B, L, KVH * D], each token's heads side by side.
        # GQA without repeating K/V or copying them into a per-head layout: each query head is
        # spread over all KVH * D columns with zeros outside its own KV head, so one batched
        # matmul against the contiguous [L, KVH * D] rows gives every head's scores (KVH times
        # the flops of a per-head product, but the same bytes, and bytes are the cost here).
        q = query if group.rows is None else query.index_select(0, group.rows)
        batch, heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        width = kv_heads * head_dim
        blocks = group.block_tables.view(-1)  # index_select: a memcpy per block, not aten::index
        k = k_cache.index_select(0, blocks).view(batch, -1, width)
        v = v_cache.index_select(0, blocks).view(batch, -1, width)
        spread = _head_spread(kv_heads, heads // kv_heads, q.dtype, q.device)
        qs = (q.view(batch, kv_heads, -1, 1, head_dim) * spread).view(batch, heads, width)
        scores = torch.bmm(qs, k.transpose(1, 2)).mul_(scale)  # [B, H, L]
        if group.bias is not None:
            scores += group.bias
        if window:  # the positions before the window's first
            positions = torch.arange(scores.shape[-1], device=scores.device)
            before = positions < (group.context_lens - window).unsqueeze(1)
            scores.masked_fill_(before.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        o = torch.bmm(probs, v).view(batch, kv_heads, -1, kv_heads, head_dim)
        o = torch.diagonal(o, dim1=1, dim2=3)  # each head's own KV head: [B, G, D, KVH]
        o = o.permute(0, 3, 1, 2).reshape(batch, heads, head_dim)
        if group.rows is None:
            out.copy_(o)
        else:
            out.index_copy_(0, group.rows, o)

    @staticmethod
    def _prefill(q, k, v, scale: float, window: int):
        # q [Q, H, D], k/v [L, KVH, D] with L >= Q: the chunk's queries are the last Q positions
        q_len, ctx_len = q.shape[0], k.shape[0]
        # [1, H, L, D]: with a batch dimension torch takes its flash kernel on CPU; 3-D inputs
        # fell back to the math path (scores materialised, several times slower)
        qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if q_len == ctx_len and not (window and window < ctx_len):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            offset = ctx_len - q_len
            rows = torch.arange(q_len, device=q.device).unsqueeze(1) + offset
            positions = torch.arange(ctx_len, device=q.device).unsqueeze(0)
            mask = positions <= rows
            if window:
                mask &= positions > rows - window
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)


@functools.lru_cache(maxsize=16)
def _head_spread(kv_heads: int, group: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """[1, KVH, 1, KVH, 1]: 1 where a query head's KV head meets its own block of columns."""
    return torch.eye(kv_heads, dtype=dtype, device=device).view(1, kv_heads, 1, kv_heads, 1)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """A sequence's context K (or V) as [context_len, KVH, D], copied block by block."""
    kv_heads, head_dim = cache.shape[-2:]
    return cache.index_select(0, block_table).view(-1, kv_heads, head_dim)[:context_len]
