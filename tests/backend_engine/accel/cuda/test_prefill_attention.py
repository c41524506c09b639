"""Paged prefill / extend attention (causal chunks over a cached prefix) against the reference."""

import pytest
import torch

from backend_engine.accel.cuda.prefill_attention import paged_prefill_attention
from tests.backend_engine.accel.cuda.paged_cases import (padded_tables, random_paged_batch,
                                                      reference_attention, step_metadata)

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _run(chunks, heads, kv_heads, head_dim, block_size, dtype, device, seed=0, window=0):
    """chunks: (cached prefix, new tokens) per sequence."""
    context_lens = [p + n for p, n in chunks]
    query_lens = [n for _, n in chunks]
    batch = random_paged_batch(context_lens, kv_heads, head_dim, block_size, dtype, device, seed)
    query = torch.randn(sum(query_lens), heads, head_dim,
                        generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    starts = torch.tensor([0] + query_lens[:-1]).cumsum(0)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(
        query.to(device), batch.k_cache, batch.v_cache,
        padded_tables(batch.block_tables, device), starts.to(torch.int32).to(device),
        torch.tensor(query_lens, dtype=torch.int32, device=device),
        torch.tensor(context_lens, dtype=torch.int32, device=device), scale,
        max_query_len=max(query_lens), window=window)
    meta = step_metadata(batch, 0, query_lens, block_size)
    expected = reference_attention(query, batch, meta, scale, window)
    torch.testing.assert_close(out.float().cpu(), expected, atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


# fresh prompts, prefix hits ending on and off block boundaries, 1-token chunks, a chunk longer
# than one query tile (32) that starts mid-block
MIXED = [(0, 1), (0, 16), (0, 33), (16, 1), (32, 17), (7, 40), (48, 16), (5, 3)]


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (32, 8)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_ragged_chunks_with_prefix_hits_match_reference(heads, kv_heads, head_dim, block_size,
                                                        device):
    _run(MIXED, heads, kv_heads, head_dim, block_size, torch.float32, device)


@pytest.mark.parametrize("window", [1, 20, 40])
def test_a_sliding_window_matches_reference(window, device):
    # windows shorter than a query tile (32) and longer; prefixes longer than the window
    _run(MIXED + [(90, 40)], 9, 3, 64, 16, torch.float32, device, window=window)


@pytest.mark.parametrize("chunk", [(0, 1), (0, 70), (64, 1), (64, 5), (31, 33)])
def test_single_chunk_matches_reference(chunk, device):
    _run([chunk], 9, 3, 64, 16, torch.float32, device)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_fp16_matches_reference(heads, kv_heads, head_dim, device):
    _run([(0, 20), (16, 16), (3, 9)], heads, kv_heads, head_dim, 16, torch.float16, device)


@pytest.mark.parametrize("heads,kv_heads,head_dim,window",
                         [(9, 3, 64, 0), (32, 8, 128, 0), (9, 3, 64, 20)])
def test_bf16_matches_reference(heads, kv_heads, head_dim, window, device):
    _run([(0, 20), (16, 16), (3, 9)], heads, kv_heads, head_dim, 16, torch.bfloat16, device,
         window=window)


def test_rows_outside_the_chunks_are_left_alone(device):
    """Decode rows come first in a step; the prefill kernel must not write over them."""
    batch = random_paged_batch([20], 3, 64, 16, torch.float32, device)
    query = torch.randn(6, 9, 64, device=device)
    out = torch.full_like(query, 7.0)
    one = torch.tensor([1], dtype=torch.int32, device=device)
    paged_prefill_attention(query, batch.k_cache, batch.v_cache,
                            padded_tables(batch.block_tables, device), one * 2, one * 4,
                            one * 20, 0.125, max_query_len=4, out=out)
    assert torch.all(out[:2] == 7.0)
    assert torch.isfinite(out[2:]).all() and not torch.any(out[2:] == 7.0)


@pytest.mark.parametrize("block_size", [1, 8, 128])
def test_other_power_of_two_block_sizes(block_size, device):
    _run([(0, 9), (120, 10), (8, 1)], 9, 3, 64, block_size, torch.float32, device)
