"""Prefill / extend attention over the paged KV cache for a variable-length batch of chunks.

Chunk c owns query rows [query_starts[c], query_starts[c] + query_lens[c]) of the step; its
context is context_lens[c] tokens, the last query_lens[c] of which are the chunk itself (already
stored), the rest a cached prefix. Query row i of the chunk sits at position
context_len - query_len + i and attends every context position up to its own (causal within the
chunk, full over the prefix; in a sliding-window layer, the `window` positions up to its own),
all read through the chunk's block table. One program per
(query tile, chunk, query head); the KV head is head // group, so K/V are never repeated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend_engine.accel.cuda.common import (LOG2E, KernelInputError, check_device,
                                           check_paged_cache, dot_dtype, dot_precision)

BLOCK_M = 32  # query rows per program
BLOCK_N = 32  # context tokens per inner-loop tile


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr,
                    query_starts_ptr, query_lens_ptr, context_lens_ptr, qk_scale, window,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_slot,
                    stride_head, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr):
    tile = tl.program_id(0)
    chunk = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    query_len = tl.load(query_lens_ptr + chunk)
    if tile * BLOCK_M >= query_len:  # the grid is sized for the longest chunk
        return
    query_start = tl.load(query_starts_ptr + chunk).to(tl.int64)
    context_len = tl.load(context_lens_ptr + chunk)
    prefix_len = context_len - query_len
    kv_head = head // GROUP

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < query_len
    d_mask = offs_d < HEAD_DIM
    rows = query_start + offs_m
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys past the tile's last query position are masked for every row: stop there.
    kv_end = tl.minimum(context_len, prefix_len + (tile + 1) * BLOCK_M)
    kv_start = 0
    if window > 0:  # nor keys before the tile's first query's window: start at its tile
        kv_start = tl.maximum(prefix_len + tile * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for kv_tile in range(kv_start, kv_end, BLOCK_N):
        pos = kv_tile + tl.arange(0, BLOCK_N)
        n_mask = pos < kv_end
        block = tl.load(block_tables_ptr + chunk * stride_bt + pos // BLOCK_SIZE, mask=n_mask,
                        other=0).to(tl.int64)
        kv_offs = ((block * BLOCK_SIZE + pos % BLOCK_SIZE) * stride_slot
                   + kv_head * stride_head)[:, None] + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        scores = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)),
                        input_precision=PRECISION) * qk_scale
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if window > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        # A row may see nothing in a tile yet (its window starts later): m_new stays -inf,
        # so subtract 0 there, never -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(DOT_DTYPE),
                                              v.to(DOT_DTYPE), input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor,
                            query_lens: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            max_query_len: int, out: torch.Tensor | None = None,
                            window: int = 0) -> torch.Tensor:
    """Attention for the prefill chunks of a step. query/out are the step's [tokens, heads,
    head_dim] (rows outside every chunk are left untouched); block_tables [chunks, max_blocks];
    query_starts, query_lens, context_lens [chunks]; max_query_len is a host int."""
    check_paged_cache(k_cache, v_cache)
    _, block_size, kv_heads, head_dim = k_cache.shape
    heads = query.shape[1]
    if query.dim() != 3 or query.shape[2] != head_dim or heads % kv_heads:
        raise KernelInputError(f"query {tuple(query.shape)} does not fit a cache of {kv_heads} "
                               f"KV heads of dim {head_dim}")
    if query.dtype != k_cache.dtype:
        raise KernelInputError(f"query is {query.dtype} but the cache is {k_cache.dtype}")
    chunks = query_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != chunks \
            or query_starts.shape != (chunks,) or context_lens.shape != (chunks,):
        raise KernelInputError("block_tables, query_starts, query_lens and context_lens need "
                               "one row per chunk")
    if block_size & (block_size - 1):
        raise KernelInputError(f"block size {block_size} is not a power of two")
    check_device(query, k_cache, block_tables, query_starts, query_lens, context_lens)
    if query.stride(2) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    if chunks == 0 or max_query_len == 0:
        return out
    grid = (triton.cdiv(max_query_len, BLOCK_M), chunks, heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, out, block_tables, query_starts, query_lens, context_lens,
        scale * LOG2E, window, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(1), k_cache.stride(2), GROUP=heads // kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        PRECISION=dot_precision(k_cache.dtype),
        DOT_DTYPE=dot_dtype(k_cache.dtype))
    return out
