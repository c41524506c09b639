"""Random paged caches and the metadata both backends read, built the way the model runner
builds them: blocks handed out in a shuffled order so a wrong block-table lookup shows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend_engine.attention.metadata import AttentionMetadata, PrefillChunk


@dataclass
class PagedBatch:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: list[list[int]]  # per sequence
    context_lens: list[int]


def random_paged_batch(context_lens: list[int], kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype, device: str, seed: int = 0,
                       spare_blocks: int = 3) -> PagedBatch:
    """Caches filled with noise everywhere (so reading a wrong slot changes the answer)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(order[used:used + n])
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    v_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    return PagedBatch(k_cache, v_cache, tables, list(context_lens))


def slots(table: list[int], block_size: int, start: int, end: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def padded_tables(tables: list[list[int]], device: str) -> torch.Tensor:
    width = max(len(t) for t in tables)
    out = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return out.to(device)


def step_metadata(batch: PagedBatch, num_decodes: int, query_lens: list[int],
                  block_size: int) -> AttentionMetadata:
    """Metadata for a step whose first num_decodes sequences decode one token and the rest
    prefill query_lens[i] new tokens at the end of their context (CPU tensors, as the runner)."""
    slot_mapping: list[int] = []
    seqs = list(zip(batch.block_tables, batch.context_lens))
    for table, ctx in seqs[:num_decodes]:
        slot_mapping += slots(table, block_size, ctx - 1, ctx)
    meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decode_tokens=num_decodes)
    if num_decodes:
        width = max(len(t) for t, _ in seqs[:num_decodes])
        tables = torch.zeros(num_decodes, width, dtype=torch.long)
        for i, (t, _) in enumerate(seqs[:num_decodes]):
            tables[i, :len(t)] = torch.tensor(t)
        meta.decode_context_lens = torch.tensor(batch.context_lens[:num_decodes])
        meta.decode_block_tables = tables
    offset = num_decodes
    for (table, ctx), n in zip(seqs[num_decodes:], query_lens):
        slot_mapping += slots(table, block_size, ctx - n, ctx)
        meta.prefills.append(PrefillChunk(offset, n, ctx,
                                          torch.tensor(table[:-(-ctx // block_size)])))
        offset += n
    meta.slot_mapping = torch.tensor(slot_mapping, dtype=torch.long)
    return meta


def reference_attention(query: torch.Tensor, batch: PagedBatch, meta: AttentionMetadata,
                        scale: float, window: int = 0) -> torch.Tensor:
    """TorchAttention in fp32 on CPU: the reference every kernel is held to."""
    from backend_engine.attention.torch_backend import TorchAttention

    return TorchAttention().forward(query.float().cpu(), batch.k_cache.float().cpu(),
                                    batch.v_cache.float().cpu(), meta, scale, window)


def naive_attention(query: torch.Tensor, batch: PagedBatch, num_decodes: int,
                    query_lens: list[int], scale: float, window: int = 0) -> torch.Tensor:
    """Attention written out per sequence and per head from the slots, in fp64: what
    TorchAttention itself is held to. window > 0: each query sees the `window` positions up to
    its own."""
    block_size, kv_heads, head_dim = batch.k_cache.shape[1:]
    flat_k = batch.k_cache.double().reshape(-1, kv_heads, head_dim)
    flat_v = batch.v_cache.double().reshape(-1, kv_heads, head_dim)
    q_lens = [1] * num_decodes + list(query_lens)
    heads = query.shape[1]
    group = heads // kv_heads
    out, row = [], 0
    for (table, ctx), n in zip(zip(batch.block_tables, batch.context_lens), q_lens):
        index = torch.tensor(slots(table, block_size, 0, ctx))
        k, v = flat_k[index], flat_v[index]  # [ctx, KVH, D]
        for j in range(n):
            visible = ctx - n + j + 1  # causal: a query sees its own position and before
            first = max(0, visible - window) if window else 0
            q = query[row + j].double()
            o = torch.empty(heads, head_dim, dtype=torch.float64)
            for h in range(heads):
                scores = (k[first:visible, h // group] @ q[h]) * scale
                o[h] = torch.softmax(scores, 0) @ v[first:visible, h // group]
            out.append(o)
        row += n
    return torch.stack(out)
