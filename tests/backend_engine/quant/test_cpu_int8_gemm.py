"""Prompt rows in integers (quant/cpu_int8_gemm.py): the two activation digits, int4 weights
requantised to int8, a row's bits wherever it sits, and the engine's prompt rows through it."""

import pytest
import torch

from backend_engine.config import EngineConfig
from backend_engine.llm import LLM
from backend_engine.models import linear
from backend_engine.models import decode_graph
from backend_engine.quant import cpu, cpu_gemm, cpu_int8_gemm, prepare
from backend_engine.quant.formats import quantize_int4, quantize_int8
from backend_engine.sampling_params import SamplingParams
from tests.backend_engine.quant.test_cpu_gemm import _last_logits


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
    w = torch.randn(out_features, 128)
    x = torch.randn(70, 128)
    w4 = quantize_int4(w, 32, "w")
    if perm:  # GPTQ act-order: groups over a permutation of the input channels
        w4.perm = torch.randperm(128)
    # int8: the weights exact, so only the activations' ~15 bits; int4: plus the requantisation
    for q, form, bound in ((cpu.prepare_int8(quantize_int8(w)), cpu_int8_gemm.int8_int8, 1e-4),
                           (cpu.prepare_int4(w4), cpu_int8_gemm.int4_int8, 2e-2)):
        for dtype in (torch.float32, torch.bfloat16):
            y = form(x.to(dtype), q)
            assert y.shape == (70, out_features) and y.dtype == dtype
            ref = x.to(dtype).float() @ q.dequantize().t()
            limit = bound if dtype == torch.float32 else 1e-2
            assert (y.float() - ref).abs().max() < limit * ref.abs().max(), (q.kind, dtype)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_rows_bits_do_not_depend_on_its_place_or_neighbours(kind):
    w = torch.randn(576, 1536)
    weight = (cpu.prepare_int8(quantize_int8(w)) if kind == "int8"
              else cpu.prepare_int4(quantize_int4(w, 32, "w")))
    form = cpu_int8_gemm.FORMS[weight.kind]
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
    fn = torch.compile(lambda x: cpu_int8_gemm.int4_int8(x, w4) * 2, fullgraph=True)
    x = torch.randn(5, 64)
    assert torch.equal(fn(x), cpu_int8_gemm.int4_int8(x, w4) * 2)


@pytest.fixture(scope="module", params=["int8", "int4"])
def integer_prompts(request):
    return LLM("tiny-random", num_kv_blocks=64, quantization=request.param,
               quantized_prefill="int8")


def test_a_prompt_gives_the_same_logits_bits_however_it_is_chunked(integer_prompts,
                                                                     monkeypatch):
    assert integer_prompts.engine.runner.model.prompt_matmul == "int8"
    calls = []
    real = cpu_int8_gemm._int8_sums
    monkeypatch.setattr(cpu_int8_gemm, "_int8_sums",
                        lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    tokens = list(range(40, 140))
    whole = _last_logits(integer_prompts, tokens, [])
    assert calls and set(calls) == {99}  # every prompt row but the last took integer sums
    for cuts in ([37], [50, 51], [99], [16, 32, 48, 64, 80, 96]):
        assert torch.equal(_last_logits(integer_prompts, tokens, cuts), whole), cuts


def test_auto_takes_the_integer_form_where_it_is_the_fastest(monkeypatch):
    weights = [[cpu.prepare_int4(quantize_int4(torch.randn(64, 64), 32, "w"))]]
    for fastest in ("int8", "gemm", "kernel"):
        monkeypatch.setattr(linear, "_measured", {})
        monkeypatch.setattr(linear, "_timings", lambda candidates, *a: {
            name: 1.0 if name == fastest else 2.0 for name in candidates})
        assert linear.choose_prompt_form(weights, "auto", torch.float32) == fastest
    assert linear.choose_prompt_form(weights, "int8", torch.float32) == "int8"


def test_int8_is_a_prefill_mode():
    EngineConfig(quantized_prefill="int8").validate()


def test_int8_sums_give_a_row_the_same_bits_compiled_or_not_at_any_row_count():
    w = cpu.prepare_int8(quantize_int8(torch.randn(3072, 576) * 0.02), sums=True)
    assert w.kind == "int8_sums_cpu" and prepare.forms(w.kind) == cpu_int8_gemm.ROW_FORMS[w.kind]
    x = torch.randn(40, 576) * torch.logspace(-2, 2, 40)[:, None]
    eager = cpu_int8_gemm.int8_sums(x, w)
    assert (eager - x @ w.dequantize().t()).abs().max() < 1e-4 * eager.abs().max()
    one = torch.compile(cpu_int8_gemm.int8_sums, dynamic=False)
    many = torch.compile(cpu_int8_gemm.int8_sums, dynamic=True)
    with torch.inference_mode():
        rows = many(x, w)
        assert torch.equal(rows, eager) and torch.equal(many(x[3:20], w), eager[3:20])
        for i in (0, 17, 39):
            assert torch.equal(one(x[i:i + 1], w), eager[i:i + 1])


def test_int8_sums_are_asked_for_and_never_the_default():
    for mode, prefill, sums in (("auto", "auto", False), ("int8", "auto", True),
                                ("kernel", "auto", False), ("auto", "int8", False)):
        llm = LLM("tiny-random", num_kv_blocks=32, quantization="int8", quantized_decode=mode,
                  quantized_prefill=prefill, compile_layers="off")
        model = llm.engine.runner.model
        assert model.int8_sums is sums, (mode, prefill)
        weight = model.layers[0].qkv_weight
        assert (weight.kind == "int8_sums_cpu") is sums
        assert model.prompt_matmul == "kernel" if sums else True  # every row in integers
        assert not decode_graph.use_frozen("int8", ((None, weight, None, weight, None, weight,
                                                     weight),))


def test_int8_is_a_decode_mode():
    EngineConfig(quantized_decode="int8").validate()


def test_int8_sums_decode_a_sequence_alone_as_in_a_batch_and_near_the_kernel():
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [list(range(40, 40 + n)) for n in (5, 23, 61, 9)]
    sums = LLM("tiny-random", num_kv_blocks=64, quantization="int8", quantized_decode="int8")
    assert sums.engine.runner.model.layers[0].qkv_weight.kind == "int8_sums_cpu"
    batch = sums.generate(prompts, params)
    alone = sums.generate(prompts[2], params)[0].outputs[0]
    assert alone.token_ids == batch[2].outputs[0].token_ids
    assert alone.logprobs == batch[2].outputs[0].logprobs  # the same bits at any batch
    kernel = LLM("tiny-random", num_kv_blocks=64, quantization="int8", quantized_decode="kernel")
    want = kernel.generate(prompts[2:3], SamplingParams(max_tokens=1, temperature=0,
                                                        logprobs=0))[0].outputs[0]
    assert want.token_ids[0] == alone.token_ids[0]
    assert abs(alone.logprobs[0].logprob - want.logprobs[0].logprob) < 0.05
