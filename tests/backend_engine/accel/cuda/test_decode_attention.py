"""Paged decode attention (flash-decoding) against the torch reference."""

import pytest
import torch

from backend_engine.accel.cuda.decode_attention import paged_decode_attention
from tests.backend_engine.accel.cuda.paged_cases import (padded_tables, random_paged_batch,
                                                      reference_attention, step_metadata)

# fp32 differs from the reference only by summation order; fp16 by fp16 rounding of q, K, V, P;
# bf16 likewise with 8 bits of mantissa (CUDA's default dtype)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# ragged, with 1 and every block-boundary neighbour of 16 and 32 (also tile boundaries at 64)
RAGGED = [1, 15, 16, 17, 31, 32, 33, 64, 65, 100]


def _run(context_lens, heads, kv_heads, head_dim, block_size, dtype, device, num_splits=None,
         seed=0, window=0):
    batch = random_paged_batch(context_lens, kv_heads, head_dim, block_size, dtype, device, seed)
    query = torch.randn(len(context_lens), heads, head_dim,
                        generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    scale = head_dim ** -0.5
    out = paged_decode_attention(
        query.to(device), batch.k_cache, batch.v_cache,
        padded_tables(batch.block_tables, device),
        torch.tensor(context_lens, dtype=torch.int32, device=device), scale,
        max_context_len=max(context_lens), num_splits=num_splits, window=window)
    meta = step_metadata(batch, len(context_lens), [], block_size)
    expected = reference_attention(query, batch, meta, scale, window)
    torch.testing.assert_close(out.float().cpu(), expected, atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (32, 8)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_ragged_batch_matches_reference(heads, kv_heads, head_dim, block_size, device):
    _run(RAGGED, heads, kv_heads, head_dim, block_size, torch.float32, device)


@pytest.mark.parametrize("window", [1, 20, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_sliding_window_matches_reference(window, num_splits, device):
    _run(RAGGED, 9, 3, 64, 16, torch.float32, device, num_splits=num_splits, window=window)


@pytest.mark.parametrize("context_len", [1, 16, 33, 200])
def test_batch_of_one_matches_reference(context_len, device):
    _run([context_len], 9, 3, 64, 16, torch.float32, device)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_split_count_does_not_change_the_answer(num_splits, device):
    # 8 splits of a 200-token context leave the short sequences with empty splits (lse = -inf)
    _run([200, 1, 40], 9, 3, 64, 16, torch.float32, device, num_splits=num_splits)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_fp16_matches_reference(heads, kv_heads, head_dim, device):
    _run([1, 17, 64, 90], heads, kv_heads, head_dim, 16, torch.float16, device)


@pytest.mark.parametrize("heads,kv_heads,head_dim,num_splits,window",
                         [(9, 3, 64, 1, 0), (32, 8, 128, 3, 0), (9, 3, 64, 3, 20)])
def test_bf16_matches_reference(heads, kv_heads, head_dim, num_splits, window, device):
    _run([1, 17, 64, 90], heads, kv_heads, head_dim, 16, torch.bfloat16, device,
         num_splits=num_splits, window=window)


def test_a_wrong_block_table_changes_the_answer(device):
    """Guards the test itself: the caches are noise, so reading other blocks is caught."""
    batch = random_paged_batch([40], 3, 64, 16, torch.float32, device)
    query = torch.randn(1, 9, 64).to(device)
    lens = torch.tensor([40], dtype=torch.int32, device=device)
    right = paged_decode_attention(query, batch.k_cache, batch.v_cache,
                                   padded_tables(batch.block_tables, device), lens, 0.125, 40)
    num_blocks = batch.k_cache.shape[0]
    shifted = [[(b + 1) % num_blocks for b in batch.block_tables[0]]]
    wrong = paged_decode_attention(query, batch.k_cache, batch.v_cache,
                                   padded_tables(shifted, device), lens, 0.125, 40)
    assert not torch.allclose(right, wrong, atol=1e-3)


def test_padding_rows_of_a_fixed_size_batch_give_zeros(device):
    """A CUDA-graph batch pads with context length 0; those rows must not turn into NaN."""
    batch = random_paged_batch([5, 16], 3, 64, 16, torch.float32, device)
    query = torch.randn(2, 9, 64).to(device)
    out = paged_decode_attention(query, batch.k_cache, batch.v_cache,
                                 padded_tables(batch.block_tables, device),
                                 torch.tensor([0, 5], dtype=torch.int32, device=device), 0.125,
                                 max_context_len=16, num_splits=2)
    assert torch.equal(out[0].cpu(), torch.zeros(9, 64))
    full = paged_decode_attention(query[1:], batch.k_cache, batch.v_cache,
                                  padded_tables(batch.block_tables[1:], device),
                                  torch.tensor([5], dtype=torch.int32, device=device), 0.125, 5)
    torch.testing.assert_close(out[1:], full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_size", [1, 8, 128])
def test_other_power_of_two_block_sizes(block_size, device):
    _run([1, 9, 128, 130], 9, 3, 64, block_size, torch.float32, device)
