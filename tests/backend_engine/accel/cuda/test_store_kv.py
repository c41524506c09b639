"""KV store by slot mapping, including rows that are not a power of two wide."""

import pytest
import torch

from backend_engine.attention.torch_backend import TorchAttention
from backend_engine.accel.cuda.store_kv import store_kv

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _caches(num_blocks, block_size, kv_heads, head_dim, dtype, device):
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return (torch.randn(shape).to(dtype=dtype, device=device),
            torch.randn(shape).to(dtype=dtype, device=device))


@pytest.mark.parametrize("kv_heads,head_dim", [(3, 64), (8, 128), (3, 128), (8, 64)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_matches_reference(kv_heads, head_dim, block_size, dtype, device):
    k_cache, v_cache = _caches(6, block_size, kv_heads, head_dim, dtype, device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    tokens = 2 * block_size + 3  # spans block boundaries, scattered across the cache
    slot_mapping = torch.randperm(6 * block_size)[:tokens]
    key = torch.randn(tokens, kv_heads, head_dim).to(dtype=dtype, device=device)
    value = torch.randn(tokens, kv_heads, head_dim).to(dtype=dtype, device=device)
    store_kv(key, value, k_cache, v_cache, slot_mapping.to(device))
    TorchAttention().store_kv(key, value, ref_k, ref_v, slot_mapping.to(device))
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_rows_sliced_from_a_fused_projection_are_stored(device):
    """The model passes k/v as views into one qkv matmul output (token stride > row width)."""
    kv_heads, head_dim = 3, 64
    k_cache, v_cache = _caches(4, 16, kv_heads, head_dim, torch.float32, device)
    qkv = torch.randn(5, (9 + 2 * kv_heads) * head_dim, device=device)
    _, k, v = qkv.split([9 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(5, kv_heads, head_dim), v.view(5, kv_heads, head_dim)
    slots = torch.tensor([0, 17, 18, 40, 63], device=device)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim)[slots], k)
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[slots], v)


def test_negative_slots_are_skipped_and_one_token_works(device):
    k_cache, v_cache = _caches(2, 16, 3, 64, torch.float32, device)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    key = torch.randn(2, 3, 64, device=device)
    store_kv(key, key * 2, k_cache, v_cache, torch.tensor([5, -1], device=device))
    expected_k, expected_v = before_k.view(-1, 3, 64).clone(), before_v.view(-1, 3, 64).clone()
    expected_k[5], expected_v[5] = key[0], key[0] * 2
    assert torch.equal(k_cache.view(-1, 3, 64), expected_k)
    assert torch.equal(v_cache.view(-1, 3, 64), expected_v)
