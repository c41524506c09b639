"""The `int8_sums` form of prompt rows (accel/cpu/int8_sums.py): the two activation digits, int4
weights requantised to int8, a row's bits wherever it sits, and the engine's prompt rows through
it."""

import pytest
import torch

from backend_engine.accel.cpu import int8_sums as cpu_int8_gemm
from backend_engine.accel.cpu import kernels as cpu
from backend_engine.accel.cpu import tiles as cpu_gemm
from backend_engine.llm import LLM
from backend_engine.quant.formats import quantize_int4, quantize_int8
from tests.backend_engine.accel.cpu.test_tiles import _last_logits


def test_two_digits_keep_about_fifteen_bits_of_each_row():
    x = torch.randn(40, 300) * torch.logspace(-3, 3, 40)[:, None]  # rows of any magnitude
    x[3, 7] = 50 * x[3].abs().max()  # an outlier channel
    q, scale = cpu_int8_gemm.digits(x)
    assert q.dtype == torch.int8 and q.shape == (80, 300) and scale.shape == (40, 1)
    back = scale * (q[:40].float() + q[40:].float() / cpu_int8_gemm.LOW_DIGIT)
    row_max = x.abs().amax(dim=1, keepdim=True)
    assert ((back - x).abs() <= row_max / (127 * 254 * 2) * 1.01).all()
    # one digit alone keeps a row's small channels to ~1/254 of its largest
    assert ((scale * q[:40].float() - x).abs() > row_max / (127 * 254)).any()
    zeros, zero_scale = cpu_int8_gemm.digits(torch.zeros(2, 8))
    assert not zeros.any() and torch.isfinite(zero_scale).all()


@pytest.mark.parametrize("out_features", [96, 200])  # 200: padded to 208 in torch's layout
def test_an_int4_weight_requantised_to_int8_stays_within_half_a_step(out_features):
    w4 = cpu.prepare_int4(quantize_int4(torch.randn(out_features, 128), 32, "w"))
    q = cpu_int8_gemm.requantize_int4(w4.packed, w4.scales_and_zeros, w4.int8_scales, 32)
    assert q.dtype == torch.int8 and q.abs().max() == 127  # each channel's largest |w| is 127
    back = q.float() * w4.int8_scales[:, None]
    v = cpu_gemm.unpack_int4(w4.packed).float().view(q.shape[0], 4, 32)  # the int4 grid, fp32
    s, z = (part.float().t()[..., None] for part in w4.scales_and_zeros.unbind(-1))
    grid = ((v - 8) * s + z).view(q.shape)
    assert ((back - grid).abs() <= w4.int8_scales[:, None] * 0.501).all()
    assert not q[out_features:].any()  # the padding rows are zero


@pytest.mark.parametrize("out_features,perm", [(200, False), (96, True)])
def test_the_integer_forms_match_the_dequantised_weights(out_features, perm):
    torch.manual_seed(out_features)
    w = torch.randn(out_features, 128)
    x = torch.randn(70, 128)
    w4 = quantize_int4(w, 32, "w")
    if perm:  # GPTQ act-order: groups over a permutation of the input channels
        w4.perm = torch.randperm(128)
    # int8: the weights exact, so only the activations' ~15 bits; int4: plus the requantisation
    for q, form, bound in ((cpu.prepare_int8(quantize_int8(w)), cpu_int8_gemm.int8_weight_sums, 1e-4),
                           (cpu.prepare_int4(w4), cpu_int8_gemm.int4_weight_sums, 2e-2)):
        for dtype in (torch.float32, torch.bfloat16):
            y = form(x.to(dtype), q)
            assert y.shape == (70, out_features) and y.dtype == dtype
            ref = x.to(dtype).float() @ q.dequantize().t()
            # bf16 activations: their rounding too (int4's requantisation bound still holds)
            limit = bound if dtype == torch.float32 else max(bound, 1e-2)
            assert (y.float() - ref).abs().max() < limit * ref.abs().max(), (q.kind, dtype)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_rows_bits_do_not_depend_on_its_place_or_neighbours(kind):
    w = torch.randn(576, 1536)
    weight = (cpu.prepare_int8(quantize_int8(w)) if kind == "int8"
              else cpu.prepare_int4(quantize_int4(w, 32, "w")))
    form = (cpu_int8_gemm.int8_weight_sums if kind == "int8" else
            cpu_int8_gemm.int4_weight_sums)
    x = torch.randn(300, 1536)
    whole = form(x, weight)
    for rows in (1, 2, 17, 64, 100, 256):
        assert torch.equal(form(x[:rows], weight), whole[:rows]), rows
    for offset in (7, 63, 150):
        assert torch.equal(form(x[offset:offset + 100], weight), whole[offset:offset + 100])
    others = torch.cat([torch.randn(5, 1536) * 100, x[:40]])
    assert torch.equal(form(others, weight)[5:], whole[:40])


def test_the_custom_ops_compile_into_a_graph():
    w4 = cpu.prepare_int4(quantize_int4(torch.randn(64, 64), 32, "w"))
    fn = torch.compile(lambda x: cpu_int8_gemm.int4_weight_sums(x, w4) * 2, fullgraph=True)
    x = torch.randn(5, 64)
    assert torch.equal(fn(x), cpu_int8_gemm.int4_weight_sums(x, w4) * 2)


@pytest.fixture(scope="module", params=["int8", "int4"])
def integer_prompts(request):
    return LLM("tiny-random", enforce_eager=True, num_kv_blocks=64,
               quantization=request.param, engine_options={"prompt": "int8_sums"})


def test_a_prompt_gives_the_same_logits_bits_however_it_is_chunked(integer_prompts,
                                                                     monkeypatch):
    assert integer_prompts.engine.runner.forward_pass.prompt_linear.name == "prompt"
    calls = []
    real = cpu_int8_gemm._int8_sums
    monkeypatch.setattr(cpu_int8_gemm, "_int8_sums",
                        lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    tokens = list(range(40, 140))
    whole = _last_logits(integer_prompts, tokens, [])
    assert calls and set(calls) == {99}  # every prompt row but the last took integer sums
    for cuts in ([37], [50, 51], [99], [16, 32, 48, 64, 80, 96]):
        assert torch.equal(_last_logits(integer_prompts, tokens, cuts), whole), cuts
