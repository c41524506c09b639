"""Decode attention over the paged KV cache, flash-decoding style.

Stage 1 splits every sequence's context into `num_splits` contiguous ranges; one program per
(sequence, KV head, split) attends all query heads of that KV head's group at once, so each K/V
tile is read once per group (GQA), and writes a partial output plus its log-sum-exp. Stage 2
merges the splits. Context positions map to slots through the block table one token at a time,
so any block size works and a tile may span several blocks.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from backend_engine.accel.cuda.common import (LOG2E, KernelInputError, check_device,
                                           check_paged_cache, dot_dtype, dot_precision)

BLOCK_N = 64  # context tokens per inner-loop tile
MIN_DOT = 16  # tl.dot needs every dimension >= 16 on GPUs


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                         part_out_ptr, part_lse_ptr, qk_scale, tokens_per_split, num_splits,
                         window,
                         stride_qt, stride_qh, stride_bt, stride_slot, stride_head,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    context_len = tl.load(context_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)
    if window > 0:  # a sliding-window layer: the positions before the window are never read
        start = tl.maximum(start, context_len - window)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=n_mask,
                        other=0).to(tl.int64)
        kv_offs = ((block * BLOCK_SIZE + pos % BLOCK_SIZE) * stride_slot
                   + kv_head * stride_head)[:, None] + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        scores = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)),
                        input_precision=PRECISION) * qk_scale
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(DOT_DTYPE),
                                              v.to(DOT_DTYPE), input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    # An empty split (context shorter than its start) stores lse = -inf and zeros, never 0/0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))
    row = (seq * num_heads + heads) * num_splits + split
    tl.store(part_lse_ptr + row, lse, mask=g_mask)
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    row = (seq * num_heads + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    # Every split is empty only for a padding row (context 0, CUDA-graph batches): write zeros.
    lse_max = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(part * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, enough to exercise the merge
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(batch: int, kv_heads: int, max_context_len: int,
                       device: torch.device) -> int:
    """Enough (sequence, KV head, split) programs to fill the GPU about twice over, never more
    splits than tiles: small batches of long contexts split most."""
    tiles = triton.cdiv(max(max_context_len, 1), BLOCK_N)
    wanted = triton.cdiv(2 * _multiprocessors(device), max(batch * kv_heads, 1))
    return max(1, min(wanted, tiles, 64))


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           max_context_len: int, out: torch.Tensor | None = None,
                           num_splits: int | None = None, window: int = 0) -> torch.Tensor:
    """One query token per sequence: query [seqs, heads, head_dim] attends the first
    context_lens[i] tokens of sequence i (window > 0: the last `window` of them), found through
    block_tables [seqs, max_blocks]. max_context_len (a host int, no device sync) sizes the
    split grid."""
    check_paged_cache(k_cache, v_cache)
    _, block_size, kv_heads, head_dim = k_cache.shape
    batch, heads = query.shape[:2]
    if query.dim() != 3 or query.shape[2] != head_dim or heads % kv_heads:
        raise KernelInputError(f"query {tuple(query.shape)} does not fit a cache of {kv_heads} "
                               f"KV heads of dim {head_dim}")
    if query.dtype != k_cache.dtype:
        raise KernelInputError(f"query is {query.dtype} but the cache is {k_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise KernelInputError("block_tables and context_lens need one row per sequence")
    if block_size & (block_size - 1):
        raise KernelInputError(f"block size {block_size} is not a power of two")
    check_device(query, k_cache, block_tables, context_lens)
    if query.stride(2) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, max_context_len, query.device)
    tokens_per_split = triton.cdiv(triton.cdiv(max(max_context_len, 1), num_splits),
                                   BLOCK_N) * BLOCK_N
    part_out = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32,
                           device=query.device)
    part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=query.device)
    group = heads // kv_heads
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, context_lens, part_out, part_lse,
        scale * LOG2E, tokens_per_split, num_splits, window,
        query.stride(0), query.stride(1), block_tables.stride(0), k_cache.stride(1),
        k_cache.stride(2), GROUP=group, BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, PRECISION=dot_precision(k_cache.dtype),
        DOT_DTYPE=dot_dtype(k_cache.dtype))
    _merge_splits_kernel[(batch, heads)](
        part_out, part_lse, out, num_splits, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_S=triton.next_power_of_2(num_splits))
    return out
