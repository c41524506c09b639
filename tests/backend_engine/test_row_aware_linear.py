"""RowAwareLinear: both matmul forms give F.linear's result; the choice is per shape and bucket."""

import pytest
import torch
import torch.nn.functional as F

from backend_engine.models.linear import BUCKETS, RowAwareLinear


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("rows", [1, 2, 3, 9, 16, 100, 129])
def test_both_forms_match_f_linear(dtype, atol, rows):
    torch.manual_seed(rows)
    weight = torch.randn(48, 32, dtype=dtype)
    bias = torch.randn(48, dtype=dtype)
    x = torch.randn(rows, 32, dtype=dtype)
    linear = RowAwareLinear()
    linear._transposed = {((48, 32), b) for b in BUCKETS}  # force the transposed form
    out = linear(x, weight, bias)
    assert out.shape == (rows, 48) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=atol, rtol=atol)
    # a view the attention layer takes must work on the result
    out.view(rows, 6, 8)


def test_choice_is_per_shape_and_bucket():
    linear = RowAwareLinear()
    linear._transposed = {((48, 32), 8)}
    assert linear.transposed((48, 32), 5) and linear.transposed((48, 32), 8)
    assert not linear.transposed((48, 32), 4)   # bucket 4
    assert not linear.transposed((48, 32), 9)   # bucket 16
    assert not linear.transposed((32, 48), 8)   # another weight
    assert not linear.transposed((48, 32), 1)   # one row is always the GEMV path


def test_calibrate_records_only_bucketed_cpu_shapes():
    linear = RowAwareLinear()
    weights = [torch.randn(64, 32), torch.randn(64, 32), torch.randn(16, 64)]
    linear.calibrate(weights, repeats=3)
    for shape, bucket in linear._transposed:
        assert shape in {(64, 32), (16, 64)} and bucket in BUCKETS
    # large row counts always use F.linear, whatever was measured
    assert not linear.transposed((64, 32), BUCKETS[-1] + 1)
