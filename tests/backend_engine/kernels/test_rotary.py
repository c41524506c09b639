"""The rotary kernel against the model's RotaryEmbedding, including a scaled RoPE variant."""

from types import SimpleNamespace

import pytest
import torch

from backend_engine.kernels.rotary import apply_rotary
from backend_engine.models.rotary import RotaryEmbedding

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _config(head_dim: int, heads: int, scaling: dict | None = None):
    if scaling is None:  # the default RoPE needs only rope_theta (no transformers on GPU boxes)
        return SimpleNamespace(rope_theta=100000.0, rope_scaling=None)
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(hidden_size=head_dim * heads, num_attention_heads=heads,
                                    max_position_embeddings=256, rope_theta=100000.0,
                                    rope_scaling=scaling)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (32, 8)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_rotary_matches_model(heads, kv_heads, head_dim, dtype, device):
    rope = RotaryEmbedding(_config(head_dim, heads), head_dim, 256, torch.float32)
    positions = torch.tensor([0, 1, 5, 17, 200, 3])
    q = torch.randn(6, heads, head_dim).to(dtype)
    k = torch.randn(6, kv_heads, head_dim).to(dtype)
    q_out, k_out = apply_rotary(positions.to(device), q.to(device), k.to(device),
                                rope.cos.to(dtype=dtype, device=device),
                                rope.sin.to(dtype=dtype, device=device))
    q_ref, k_ref = rope(positions, q.float(), k.float())
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(q_out.float().cpu(), q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k_out.float().cpu(), k_ref, atol=tol, rtol=tol)


def test_llama3_scaled_rope_and_strided_views(device):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(_config(64, 4, scaling), 64, 256, torch.float32)
    qkv = torch.randn(3, (4 + 2 * 2) * 64)
    q, k, _ = qkv.split([256, 128, 128], dim=-1)
    q, k = q.view(3, 4, 64), k.view(3, 2, 64)  # views with a token stride of 512
    positions = torch.tensor([0, 100, 255])
    q_out, k_out = apply_rotary(positions.to(device), q.to(device), k.to(device),
                                rope.cos.to(device), rope.sin.to(device))
    q_ref, k_ref = rope(positions, q, k)
    torch.testing.assert_close(q_out.cpu(), q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out.cpu(), k_ref, atol=1e-5, rtol=1e-5)
