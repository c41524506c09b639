"""Triton weight-only int8/int4 matmuls against the torch dequantise-then-matmul reference, in
both launch shapes (decode: few rows; prefill: GEMM tiles)."""

import pytest
import torch
import torch.nn.functional as F

from backend_engine.accel.cuda.common import KernelInputError
from backend_engine.accel.cuda.quant_matmul import int4_matmul, int8_matmul
from backend_engine.accel.cuda import weights as cuda
from backend_engine.quant.formats import Int4Weight, quantize_int4, quantize_int8

SHAPES = [(1, 40, 128), (5, 72, 256), (33, 64, 192)]  # (rows, out, in): ragged tiles, both shapes


def _data(rows, n, k, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(rows, k, generator=g).to(dtype)
    return w, x.to(device)


def _tol(dtype):
    return 1e-4 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("rows,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matches_dequantize_then_matmul(rows, n, k, dtype, device):
    w, x = _data(rows, n, k, dtype, device)
    q = quantize_int8(w)
    out = int8_matmul(x, q.qweight.to(device), q.scales.to(device))
    ref = F.linear(x.float(), q.dequantize().to(device))
    assert out.dtype == dtype and out.shape == (rows, n)
    torch.testing.assert_close(out.float(), ref, atol=_tol(dtype), rtol=_tol(dtype))


@pytest.mark.parametrize("rows,n,k", SHAPES)
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_matches_dequantize_then_matmul(rows, n, k, group_size, dtype, device):
    w, x = _data(rows, n, k, dtype, device, seed=group_size)
    q = quantize_int4(w, group_size)
    out = int4_matmul(x, q.qweight.to(device), q.scales.to(device), q.mins.to(device),
                      group_size)
    ref = F.linear(x.float(), q.dequantize().to(device))
    torch.testing.assert_close(out.float(), ref, atol=_tol(dtype), rtol=_tol(dtype))


def test_act_order_weights_go_through_the_linear_form(device):
    w, x = _data(3, 32, 128, torch.float32, device, seed=7)
    q = quantize_int4(w, 32)
    q = Int4Weight(q.qweight, q.scales, q.mins, 32, torch.randperm(128))
    prepared = cuda.prepare(q, device)
    out = (cuda.int8_mm if prepared.kind == "int8_triton" else cuda.int4_mm)(x, prepared)
    torch.testing.assert_close(out, F.linear(x, q.dequantize().to(device)), atol=1e-4, rtol=1e-4)


def test_bad_shapes_are_refused(device):
    q = quantize_int4(torch.randn(16, 64), 32)
    with pytest.raises(KernelInputError, match="x must be"):
        int4_matmul(torch.randn(2, 32, device=device), q.qweight.to(device),
                    q.scales.to(device), q.mins.to(device), 32)
    with pytest.raises(KernelInputError, match="scales"):
        int8_matmul(torch.randn(2, 64, device=device),
                    torch.zeros(16, 64, dtype=torch.int8, device=device),
                    torch.ones(8, device=device))
