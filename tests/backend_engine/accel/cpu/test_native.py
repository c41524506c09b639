"""`kvgate::int8_gemm` (accel/cpu/native.py): exact integer sums from the AVX2 kernel, the same
as torch's reference loop, and `w8a8` giving the same bits whichever of them runs."""

from __future__ import annotations

import logging

import pytest
import torch

from backend_engine.accel.cpu import kernels, native
from backend_engine.quant.formats import quantize_int8

needs_avx2 = pytest.mark.skipif(native.library() is None,
                                reason="the AVX2 kernel runs on x86 with AVX2 and a C compiler")


def _exact(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.long() @ b.long().t()


@needs_avx2
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (1, 7, 640), (2, 3, 31), (5, 10, 70),
                                   (17, 50, 576), (50, 49, 2048 + 13), (97, 4, 96)])
def test_the_sums_are_exact_for_any_shape_and_tail(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    assert torch.equal(native.int8_gemm(a, b).long(), _exact(a, b))


@needs_avx2
def test_the_largest_pairs_do_not_saturate():
    # -127 x -128 in every lane: each 16-bit pair sums to 32,512, and oneDNN's u8s8 form
    # (a + 128 = 1, 255 ...) is where saturation would show; here every sum stays exact
    k = 4096
    a = torch.tensor([[-127] * k, [127] * k, [-127, 127] * (k // 2)], dtype=torch.int8)
    b = torch.tensor([[-128] * k, [127] * k, [-128, 127] * (k // 2)], dtype=torch.int8)
    assert torch.equal(native.int8_gemm(a, b).long(), _exact(a, b))


@needs_avx2
def test_the_sums_do_not_depend_on_threads_or_strides():
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-127, 128, (40, 300), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (90, 300), dtype=torch.int8, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.int8_gemm(a, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, native.int8_gemm(a, b))
    wide = torch.zeros(40, 400, dtype=torch.int8)
    wide[:, :300] = a
    assert torch.equal(native.int8_gemm(wide[:, :300], b), one)  # a strided view is copied


def test_w8a8_gives_the_same_bits_from_every_source_of_sums(monkeypatch):
    """This kernel, torch._int_mm and (on a CPU with VNNI) oneDNN: one answer."""
    g = torch.Generator().manual_seed(2)
    w = quantize_int8(torch.randn(70, 160, generator=g))
    plain = kernels.CpuW8A8Weight(w.qweight.contiguous(), w.scales.float().contiguous(),
                                  onednn=False)
    x = torch.randn(19, 160, generator=g, dtype=torch.float32) * 3
    here = kernels.w8a8_mm(x, plain)
    prepared = kernels.prepare_w8a8(w)
    assert torch.equal(kernels.w8a8_mm(x, prepared), here)  # oneDNN's where the CPU has VNNI
    monkeypatch.setattr(native, "library", lambda: None)  # torch._int_mm instead
    assert torch.equal(kernels.w8a8_mm(x, plain), here)


def test_a_failed_build_is_logged_and_the_sums_still_come(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    monkeypatch.setenv("KVGATE_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setattr(native, "cpu_flags", lambda: ["avx2"])
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kvgate.engine"):
            assert native.library() is None
        assert "did not build" in caplog.text
        assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-written kept
        a = torch.tensor([[1, -2, 3]], dtype=torch.int8)
        b = torch.tensor([[4, 5, -6], [7, 8, 9]], dtype=torch.int8)
        assert native.int8_gemm(a, b).tolist() == [[-24, 18]]
    finally:
        native.library.cache_clear()
