"""Fused RMSNorm (+ residual add) against the model's torch RMSNorm."""

import pytest
import torch

from backend_engine.kernels.rms_norm import fused_add_rms_norm, rms_norm
from backend_engine.models.llama import rms_norm as reference_rms_norm

# fp32: summation order only; half types: the reference itself computes in the half type
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3),
             torch.bfloat16: (2e-2, 2e-2)}
HIDDEN = [576, 64, 1000]  # SmolLM2's 576 and a width that is no multiple of anything useful


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_rms_norm_matches_model(hidden, dtype, device):
    x = torch.randn(7, hidden).to(dtype)
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    out = rms_norm(x.to(device), weight.to(device), 1e-5)
    expected = reference_rms_norm(x.float(), weight.float(), 1e-5)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_fused_add_matches_add_then_norm(hidden, dtype, device):
    x = torch.randn(5, hidden).to(dtype)
    residual = torch.randn(5, hidden).to(dtype)
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    out, new_residual = fused_add_rms_norm(x.to(device), residual.to(device), weight.to(device),
                                           1e-6)
    summed = x + residual  # rounded to dtype, as the unfused model does
    # exact, except that triton's interpreter rounds fp32 -> bf16 toward zero (GPUs round to
    # nearest): one bf16 ulp there
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(new_residual.cpu(), summed, atol=0.0, rtol=ulp)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(),
                               reference_rms_norm(summed.float(), weight.float(), 1e-6),
                               atol=atol, rtol=rtol)


def test_single_row_and_3d_input_keep_their_shape(device):
    x = torch.randn(1, 1, 576, device=device)
    weight = torch.ones(576, device=device)
    out = rms_norm(x, weight, 1e-5)
    assert out.shape == x.shape
    torch.testing.assert_close(out.cpu(), reference_rms_norm(x.cpu(), weight.cpu(), 1e-5))
