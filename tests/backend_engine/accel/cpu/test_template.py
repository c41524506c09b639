"""Prompt rows of int4 CPU weights through Inductor's GEMM template (accel/cpu/template.py): it
computes what torch's kernel computes, gives a row the same bits wherever it sits, keeps each
weight's own values through Inductor's cache, lives as long as its weight, and an engine that
takes it gives a prompt's last row the same logits however the prompt was chunked."""

import gc

import pytest
import torch

from backend_engine.accel.compile import own_copy
from backend_engine.accel.cpu import kernels as cpu
from backend_engine.accel.cpu import template as cpu_template
from backend_engine.accel.cpu import tiles
from backend_engine.config import EngineConfig
from backend_engine.llm import LLM
from backend_engine.models.linear import Linear
from backend_engine.quant.formats import quantize_int4
from tests.backend_engine.accel.cpu.test_tiles import _last_logits

SHAPE = (3072, 576)  # SmolLM2's gate_up


def _weight(seed: int, shape=SHAPE) -> cpu.CpuInt4Weight:
    gen = torch.Generator().manual_seed(seed)
    return cpu.prepare_int4(quantize_int4(torch.randn(*shape, generator=gen), 32, "w"))


def _kernel(x: torch.Tensor, w: cpu.CpuInt4Weight) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.packed, w.group_size,
                                                     w.scales_and_zeros)


def _no_micro_kernel() -> bool:
    """Inductor's int4 micro-kernels are AVX512 and AMX ones: elsewhere no template is built."""
    return torch.backends.cpu.get_cpu_capability() != "AVX512"


def _template(w: cpu.CpuInt4Weight) -> cpu_template.TemplateMatmul:
    template = cpu_template.compile_for(w)
    if template is None and _no_micro_kernel():
        pytest.skip("no int4 GEMM template on a CPU without AVX512")
    assert template is not None, "Inductor could not build the int4 template here"
    return template


@pytest.fixture(scope="module")
def compiled():
    w = _weight(0)
    return w, _template(w)


def test_the_template_computes_what_the_kernel_computes(compiled):
    w, template = compiled
    for rows in (1, 2, 37, 200):
        x = torch.randn(rows, SHAPE[1]).to(torch.bfloat16)
        y, ref = template(x).float(), _kernel(x, w).float()
        assert y.shape == ref.shape
        assert (y - ref).abs().max() <= 2e-2 * ref.abs().max(), rows


def test_a_rows_bits_do_not_depend_on_its_place_or_neighbours(compiled):
    _, template = compiled
    x = torch.randn(300, SHAPE[1]).to(torch.bfloat16)
    whole = template(x)
    for rows in (1, 2, 3, 16, 17, 64, 100, 256):
        assert torch.equal(template(x[:rows]), whole[:rows]), rows
    for offset in (7, 63, 150):
        assert torch.equal(template(x[offset:offset + 100]), whole[offset:offset + 100]), offset
    others = torch.cat([torch.randn(5, SHAPE[1]).to(torch.bfloat16) * 100, x[:40]])
    assert torch.equal(template(others)[5:], whole[:40])


def test_two_weights_of_one_shape_keep_their_own_values(compiled):
    # Inductor's FX-graph cache does not key frozen constants: without the weight's digest in
    # the key, the second compile got the first weight's values (off by ~8 here)
    first, _ = compiled
    second = _weight(1)
    template = _template(second)
    x = torch.randn(20, SHAPE[1]).to(torch.bfloat16)
    ref = _kernel(x, second).float()
    assert (template(x).float() - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert not torch.equal(_kernel(x, first), _kernel(x, second))


def test_an_attached_template_goes_with_its_weight(compiled):
    w, template = _weight(2, (256, 128)), compiled[1]
    cpu_template.attach(w, template)
    assert cpu_template.lookup(w.packed) is template
    assert cpu_template.extra_bytes(w) == template.nbytes > 0
    ptr, packed = w.packed.data_ptr(), w.packed
    del w
    gc.collect()
    assert ptr not in cpu_template._attached._by_ptr
    assert cpu_template.lookup(packed) is None


def test_weights_with_templates_still_share_one_compiled_layer_graph():
    # compiled layers take every layer's weights as inputs of one graph; once a template's
    # compile had marked the weight's own tensors static, Dynamo guarded on each weight's
    # identity there and recompiled per layer until it gave up (the layers then ran eager)
    from torch._dynamo.utils import counters  # imports triton: not at collection

    traced_linear = Linear("kernel", {cpu.CpuInt4Weight.kind: cpu.int4_mm})
    fn = torch.compile(own_copy(lambda x, w: traced_linear(x, w)), dynamic=False,
                       fullgraph=True)
    x = torch.randn(3, 128).to(torch.bfloat16)
    weights = [_weight(10 + i, (256, 128)) for i in range(3)]
    for w in weights:
        cpu_template.attach(w, _template(w))
    graphs = counters["stats"]["unique_graphs"]
    for w in weights:
        assert torch.equal(fn(x, w), traced_linear(x, w))
    assert counters["stats"]["unique_graphs"] - graphs == 1


def test_a_template_that_fails_to_run_leaves_the_prompt_rows_to_the_tiles(compiled):
    w = _weight(3, (256, 128))
    template = cpu_template.TemplateMatmul(w)
    template._fn._graphs[()] = lambda x: 1 / 0  # as a recompile Inductor cannot do would raise
    cpu_template.attach(w, template)
    x = torch.randn(9, 128)
    y = cpu_template.int4_template(x, w)
    assert template.failed and template(x) is None
    del cpu_template._attached._by_ptr[w.packed.data_ptr()]
    assert torch.equal(y, tiles.int4_tiles(x, w))  # the dequantise + GEMM tiles


@pytest.fixture(scope="module")
def templated():
    if _no_micro_kernel():  # checked first: the engine would compile its layers for nothing
        pytest.skip("no int4 GEMM template on a CPU without AVX512")
    llm = LLM("tiny-random", num_kv_blocks=64, quantization="int4",
              engine_options={"device_class": "cpu-amx"})  # the plan that takes the template
    forward = llm.engine.runner.forward_pass
    templates = [cpu_template.lookup(w.packed) for w in forward.model.linear_weights()]
    assert all(templates) and forward.plan.prompt["int4"] == "template"
    assert all(layers is not None for layers in forward.layers.values())  # compiled
    return llm


def test_a_templated_prompt_gives_the_same_logits_bits_however_it_is_chunked(templated,
                                                                             monkeypatch):
    from torch._dynamo.utils import counters  # imports triton: not at collection

    rows = []
    real = cpu_template.TemplateMatmul.__call__
    monkeypatch.setattr(cpu_template.TemplateMatmul, "__call__",
                        lambda self, x: rows.append(x.shape[0]) or real(self, x))
    tokens = list(range(40, 140))
    whole = _last_logits(templated, tokens, [])
    assert rows and set(rows) == {99}  # every prompt row but the last took the template
    graphs = counters["stats"]["unique_graphs"]
    for cuts in ([37], [50, 51], [98], [99], [16, 32, 48, 64, 80, 96]):
        assert torch.equal(_last_logits(templated, tokens, cuts), whole), cuts
    # steps' rows pass the templates' guards: nothing compiled again (a recompile would
    # leave the template for torch's kernel, silently)
    assert counters["stats"]["unique_graphs"] == graphs


def test_template_is_no_prompt_form_of_int8_weights():
    EngineConfig(engine_options={"prompt": "int4:template"}).validate()
    with pytest.raises(ValueError, match="template"):
        EngineConfig(engine_options={"prompt": "int8:template"}).validate()
