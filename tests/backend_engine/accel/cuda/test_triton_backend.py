"""TritonAttention behind the AttentionBackend interface: mixed steps, and backend selection."""

import sys

import pytest
import torch

from backend_engine.accel.attention import AttentionBackendUnavailableError, get_attention_backend
from backend_engine.attention.metadata import build_kernel_metadata
from backend_engine.attention.torch_backend import TorchAttention
from tests.backend_engine.accel.cuda.paged_cases import random_paged_batch, step_metadata


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window,dtype",
                         [(9, 3, 64, 16, 0, torch.float32), (32, 8, 128, 32, 0, torch.float32),
                          (9, 3, 64, 16, 20, torch.float32), (9, 3, 64, 16, 0, torch.bfloat16)])
def test_mixed_step_matches_torch_backend(heads, kv_heads, head_dim, block_size, window, dtype,
                                          device):
    """Decodes first, then a fresh prompt, a prefix hit and a spec-verify-sized chunk; the new
    K/V go through store_kv first, as the model calls it (and a sliding-window layer's step)."""
    decode_lens, chunks = [1, 17, 40], [(0, 21), (32, 5), (50, 4)]
    context_lens = decode_lens + [p + n for p, n in chunks]
    query_lens = [n for _, n in chunks]
    batch = random_paged_batch(context_lens, kv_heads, head_dim, block_size, dtype, "cpu")
    meta = step_metadata(batch, len(decode_lens), query_lens, block_size)
    tokens = len(decode_lens) + sum(query_lens)
    query, key, value = (torch.randn(tokens, h, head_dim).to(dtype)
                         for h in (heads, kv_heads, kv_heads))
    scale = head_dim ** -0.5

    ref = TorchAttention()
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    ref.store_kv(key, value, ref_k, ref_v, meta.slot_mapping)
    expected = ref.forward(query, ref_k, ref_v, meta, scale, window)

    triton_attn = get_attention_backend("triton", device)
    k_cache, v_cache = batch.k_cache.to(device), batch.v_cache.to(device)
    triton_attn.store_kv(key.to(device), value.to(device), k_cache, v_cache, meta.slot_mapping)
    out = triton_attn.forward(query.to(device), k_cache, v_cache, meta, scale, window)
    assert torch.equal(k_cache.cpu(), ref_k) and torch.equal(v_cache.cpu(), ref_v)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=tolerance,
                               rtol=tolerance)
    first = meta.kernel  # later layers reuse the step's kernel metadata
    triton_attn.forward(query.to(device), k_cache, v_cache, meta, scale)
    assert meta.kernel is first


def test_prefill_block_tables_are_padded_per_chunk():
    batch = random_paged_batch([40, 16], 3, 64, 16, torch.float32, "cpu")
    meta = step_metadata(batch, 0, [40, 3], 16)
    kernel = build_kernel_metadata(meta, "cpu")
    assert kernel.prefill_block_tables.tolist() == [batch.block_tables[0],
                                                    batch.block_tables[1] + [0, 0]]
    assert kernel.prefill_query_starts.tolist() == [0, 40]
    assert kernel.prefill_context_lens.tolist() == [40, 16]
    assert kernel.max_prefill_query_len == 40


def test_backend_selection(device):
    from backend_engine.accel.plan import plan_for

    assert plan_for("cpu").attention == "torch" and plan_for("cuda").attention == "triton"
    assert get_attention_backend("torch", "cpu").name == "torch"
    assert get_attention_backend("triton", device).name == "triton"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", "cpu")


def test_missing_triton_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "backend_engine.accel.cuda.attention", None)
    with pytest.raises(AttentionBackendUnavailableError, match="pip install 'kvgate\\[gpu\\]'"):
        get_attention_backend("triton", "cuda")
