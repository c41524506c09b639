"""RowAwareLinear: every matmul form gives F.linear's result; the choice is per shape and bucket."""

import pytest
import torch
import torch.nn.functional as F

from backend_engine.models.linear import BUCKETS, FORMS, RowAwareLinear


CASES = [(form, rows) for form in sorted(FORMS) for rows in (1, 2, 3, 9, 16, 100, 129)
         if rows == 1 or not form.startswith("pad")]  # padding is a one-row form


@pytest.mark.parametrize("form,rows", CASES)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_every_form_matches_f_linear(form, rows, dtype, atol):
    torch.manual_seed(rows)
    weight = torch.randn(48, 32, dtype=dtype)
    bias = torch.randn(48, dtype=dtype)
    x = torch.randn(rows, 32, dtype=dtype)
    linear = RowAwareLinear()
    linear._choice = {((48, 32), b): form for b in BUCKETS}  # force this form
    out = linear(x, weight, bias)
    assert out.shape == (rows, 48) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=atol, rtol=atol)
    out.view(rows, 6, 8)  # the view the attention layer takes must work on the result


def test_choice_is_per_shape_and_bucket():
    linear = RowAwareLinear()
    linear._choice = {((48, 32), 8): "flip", ((48, 32), 1): "pad_linear"}
    assert linear.form((48, 32), 5) == linear.form((48, 32), 8) == "flip"
    assert linear.form((48, 32), 1) == "pad_linear"
    assert linear.form((48, 32), 4) == "linear"    # bucket 4
    assert linear.form((48, 32), 9) == "linear"    # bucket 16
    assert linear.form((32, 48), 8) == "linear"    # another weight
    assert linear.form((48, 32), BUCKETS[-1] + 1) == "linear"  # large row counts


def test_calibrate_measures_each_shape_once_per_process():
    from backend_engine.models import linear as module

    groups = [[torch.randn(64, 32), torch.randn(64, 32)], [torch.randn(16, 64)]]
    first, second = RowAwareLinear(), RowAwareLinear()
    first.calibrate(groups, repeats=3)
    measured = dict(module._measured)
    second.calibrate(groups + [[torch.randn(64, 32)]], repeats=3)
    assert module._measured == measured  # nothing timed again
    assert first._choice == second._choice  # engines in one process agree
    for shape, bucket in first._choice:
        assert shape in {(64, 32), (16, 64)} and bucket in BUCKETS
