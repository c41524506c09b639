"""Quantised formats: round-trip error bounds, row fusion, shards, and the CPU kernels' forms
against dequantise-then-matmul."""

import pytest
import torch
import torch.nn.functional as F

from backend_engine.accel import forms
from backend_engine.accel.cpu import kernels as cpu
from backend_engine.accel.prepare import prepare, quantize
from backend_engine.errors import ModelLoadError
from backend_engine.models.linear import REFERENCE, Linear
from backend_engine.quant.formats import (Int4Weight, Int8Weight, cat_rows, narrow,
                                          quantize_int4, quantize_int8)


def _weight(n=48, k=128, seed=0):
    torch.manual_seed(seed)
    return torch.randn(n, k) * 0.05


def test_int8_error_is_at_most_half_a_step_per_channel():
    w = _weight()
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.shape == w.shape
    err = (q.dequantize() - w).abs()
    assert bool((err <= q.scales[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_per_group_is_no_worse_than_plain_min_max(group_size):
    w = _weight(k=256)
    q = quantize_int4(w, group_size)
    assert q.qweight.shape == (48, 128) and q.scales.shape == (48, 256 // group_size)
    groups = w.view(48, -1, group_size)
    err = ((q.dequantize().view_as(groups) - groups) ** 2).sum(-1)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    plain = ((torch.round((groups - lo) / step) * step + lo - groups) ** 2).sum(-1)
    assert bool((err <= plain + 1e-9).all()) and err.sum() < plain.sum()


def test_a_group_size_that_does_not_divide_the_input_names_the_tensor():
    with pytest.raises(ModelLoadError, match=r"128 \(--quantization-group-size\).*576.*"
                       r"model\.layers\.0\.mlp\.down_proj\.weight.*\[32, 64\]"):
        quantize(torch.randn(16, 576), "int4", 128, "model.layers.0.mlp.down_proj.weight")


def test_fused_rows_dequantize_to_the_concatenation():
    parts = [quantize_int4(_weight(n, seed=n), 32) for n in (16, 32)]
    fused = cat_rows(parts)
    assert isinstance(fused, Int4Weight)
    torch.testing.assert_close(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_mixed_formats_fuse_in_int8():
    a, b = quantize_int4(_weight(16, seed=1), 32), quantize_int8(_weight(16, seed=2))
    fused = cat_rows([a, b])
    assert isinstance(fused, Int8Weight)
    ref = torch.cat([a.dequantize(), b.dequantize()])
    assert (fused.dequantize() - ref).abs().max() <= fused.scales.max()


@pytest.mark.parametrize("make", [quantize_int8, lambda w: quantize_int4(w, 32)])
def test_row_and_column_shards_dequantize_to_slices(make):
    w = make(_weight(k=128))
    full = w.dequantize()
    torch.testing.assert_close(narrow(w, 0, 16, 16).dequantize(), full[16:32])
    torch.testing.assert_close(narrow(w, 1, 32, 64).dequantize(), full[:, 32:96])


def test_int4_column_shards_must_cover_whole_groups():
    with pytest.raises(ValueError, match="whole groups"):
        narrow(quantize_int4(_weight(), 32), 1, 16, 32)


def _act_order(w: Int4Weight, seed: int = 0) -> Int4Weight:
    """The same grouped values, read under a shuffled input order (as GPTQ act-order stores)."""
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(seed))
    return Int4Weight(w.qweight, w.scales, w.mins, w.group_size, perm)


CASES = [("int8", lambda: quantize_int8(_weight(40, 128))),
         ("int4", lambda: quantize_int4(_weight(40, 128), 32)),  # 40 rows: padded to 48
         ("int4_act_order", lambda: _act_order(quantize_int4(_weight(48, 128), 64)))]


@pytest.mark.parametrize("name,make", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("rows", [1, 3, 17, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_cpu_form_matches_the_reference(name, make, rows, dtype):
    """Each form the plan may name for a CPU weight (accel/forms.py) gives the reference form's
    product (the stored values dequantised, then F.linear) within bf16's rounding."""
    w = make()
    prepared = prepare(w, "cpu", dtype)
    torch.testing.assert_close(prepared.dequantize(), w.dequantize(), atol=2e-3, rtol=1e-2)
    x = torch.randn(rows, 128, dtype=dtype)
    bias = torch.randn(w.shape[0], dtype=dtype)
    ref = REFERENCE(x.float(), prepared, bias.float())
    kind_forms = [form for (form, kind) in forms._cpu_functions() if kind == prepared.kind]
    assert {"kernel", "tiles", "int8_sums"} <= set(kind_forms)
    for form in kind_forms:
        out = Linear(form, {prepared.kind: forms._cpu_functions()[form, prepared.kind]})(
            x, prepared, bias)
        assert out.dtype == dtype and out.shape == (rows, w.shape[0]) and out.is_contiguous()
        scale = ref.abs().max()
        assert (out.float() - ref).abs().max() <= 2e-2 * scale, form


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_is_close_to_dequantize_then_matmul_and_a_row_ignores_its_batch(dtype):
    w = quantize_int8(_weight(40, 128))
    prepared = cpu.prepare_w8a8(w)
    assert prepared.kind == "w8a8_cpu" and prepared.shape == (40, 128)
    torch.testing.assert_close(prepared.dequantize(), w.dequantize(), atol=0, rtol=1e-6)
    x = torch.randn(33, 128, dtype=dtype) * torch.linspace(0.01, 30, 33)[:, None].to(dtype)
    x[5] = 0  # a zero row: no division by zero
    linear = Linear("w8a8", {prepared.kind: cpu.w8a8_mm})
    out = linear(x, prepared)
    assert out.dtype == dtype and out.shape == (33, 40) and torch.isfinite(out).all()
    assert not out[5].any()
    ref = F.linear(x.float(), w.dequantize())
    # each row's activations in 8 bits by its own max: the error scales with the row
    err = (out.float() - ref).abs().amax(dim=1)
    assert (err <= 2e-2 * ref.abs().amax(dim=1) + 1e-6).all()
    for i in (0, 5, 17, 32):  # a row's bits are the same alone as in any batch
        assert torch.equal(linear(x[i:i + 1], prepared)[0], out[i])
    assert torch.equal(linear(x[3:20], prepared), out[3:20])


