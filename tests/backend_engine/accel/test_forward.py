"""The plan's forward pass (accel/forward.py) on the tiny models, as production runs it: compiled
layers and the compiled decode step give the eager logits of the same forms, and the reference
path's within a stated tolerance; every row through the same code whatever its step holds (a
sequence's tokens do not depend on its batch); no recompiles after start-up; eager (or the next
form) when compiling fails."""

import pytest
import torch

from backend_engine.accel import compiled_layers as cl
from backend_engine.accel import decode_step
from backend_engine.accel.cpu.tiles import TILE_ROWS
from backend_engine.accel.plan import plan_for
from backend_engine.llm import LLM
from backend_engine.sampling_params import SamplingParams
from backend_engine.step_batch import StepBatch
from tests.backend_engine.helpers import assert_answers_close

PROMPTS = ["a long way " * 40, "short", "x y z " * 90, "the cat sat on the mat " * 5]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
# The production engines' settings: a test building another with these finds its graphs in
# Inductor's cache (the pool size is a constant of the decode step's graph).
PRODUCTION = dict(num_kv_blocks=256, max_num_batched_tokens=64)


def _logits(llm, token_ids: list[int]) -> torch.Tensor:
    """One prefill step, every row a prompt row; the last row's logits."""
    runner = llm.engine.runner
    blocks = list(range(-(-len(token_ids) // runner.block_size)))
    batch = StepBatch(token_ids=[token_ids], num_computed_tokens=[0], block_ids=[blocks],
                      num_tokens=[len(token_ids)])
    return runner.forward_batch(batch)[1]


def _decode_logits(llm, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Logits of a prefill of tokens[:prompt_len], then of one decode step per further token
    (teacher-forced), each step writing its K/V and reading the ones before."""
    runner = llm.engine.runner
    blocks = list(range(-(-len(tokens) // runner.block_size)))
    prefill = StepBatch([tokens[:prompt_len]], [0], [prompt_len], [blocks])
    logits = [runner.forward_batch(prefill)[1][-1]]
    for n in range(prompt_len, len(tokens)):
        step = StepBatch([[tokens[n]]], [n], [n + 1], [blocks])
        logits.append(runner.forward_batch(step)[1][0])
    return torch.stack(logits)


def _eager(monkeypatch, llm) -> None:
    """The same plan's forms, nothing compiled."""
    forward = llm.engine.runner.forward_pass
    monkeypatch.setattr(forward, "decode_step", None)
    monkeypatch.setattr(forward, "layers", dict.fromkeys(forward.layers))


@pytest.fixture(scope="module", params=[None, "int8", "int4"], ids=["fp32", "int8", "int4"])
def production(request):
    """A tiny model as `kvgate engine` runs it by default on this machine: the plan compiles."""
    return LLM("tiny-random", quantization=request.param, **PRODUCTION)


def test_the_tiny_models_take_the_production_plan(production):
    forward = production.engine.runner.forward_pass
    expected = plan_for("cpu")
    assert forward.plan.compiled and forward.plan.device_class == expected.device_class
    assert forward.decode_step is not None and forward.decode_step.cpp_wrapper
    assert all(layers is not None for layers in forward.layers.values())
    assert forward.describe().startswith(f"plan for {expected.device_class}:")
    # where prompt rows take 64-row tiles, the step budget fills whole tiles with prefill
    tiles = expected.prompt[production.engine.config.quantization or "fp"] == "tiles"
    assert forward.prompt_row_granule == (TILE_ROWS if tiles else 1)


def test_compiled_layers_and_the_decode_step_give_the_eager_logits(production, monkeypatch):
    tokens = list(range(7, 47))  # 3 blocks of 16: decode rows cross block boundaries
    compiled = _decode_logits(production, tokens, 10)
    _eager(monkeypatch, production)
    eager = _decode_logits(production, tokens, 10)
    # fp32 weights: fused fp32 ops round apart by ulps; quantised kernels return bf16, so those
    # ulps may flip a bf16 rounding: about one bf16 step (2^-8) of the largest logit
    bound = 1e-4 if production.engine.config.quantization is None else 1e-2
    torch.testing.assert_close(compiled, eager, atol=bound * eager.abs().max().item(), rtol=0)


def test_the_plan_answers_as_the_reference_path(production):
    """The fast forms change speed, not answers: the reference path's greedy tokens (eager,
    every weight dequantised, F.linear) but at near-ties, and its logprobs within 1e-3 with
    fp32 weights, 0.1 with quantised ones: their kernels compute in bf16 and return the logits
    rounded to it (one bf16 step at these logits is ~0.06), the reference in fp32. The tiny
    random model's logits are nearly flat: near-ties are common there."""
    quantization = production.engine.config.quantization
    reference = LLM("tiny-random", num_kv_blocks=256, quantization=quantization,
                    max_num_batched_tokens=64, engine_options={"plan": "reference"})
    assert not reference.engine.runner.forward_pass.plan.compiled
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    fast = [o.outputs[0] for o in production.generate(PROMPTS, params)]
    ref = [o.outputs[0] for o in reference.generate(PROMPTS, params)]
    assert_answers_close(fast, ref, 1e-3 if quantization is None else 0.1)


@pytest.fixture(scope="module", params=["int8", "int4"])
def reference_llm(request):
    return LLM("tiny-random", num_kv_blocks=256, quantization=request.param,
               max_num_batched_tokens=64, engine_options={"plan": "reference"})


@pytest.mark.parametrize("prompt_form", ["kernel", "tiles", "int8_sums"])
def test_every_prompt_form_answers_as_the_reference_path(reference_llm, prompt_form):
    """The forms of other device classes' plans, run here eager: the reference path's answers
    within 0.15 (the plan's own bound, widened for int8_sums, which requantises int4 weights to
    int8 per channel for the call; the template form is Inductor's, tested where it builds:
    tests/backend_engine/accel/cpu/test_template.py)."""
    quantization = reference_llm.engine.config.quantization
    llm = LLM("tiny-random", num_kv_blocks=256, quantization=quantization,
              max_num_batched_tokens=64, enforce_eager=True,
              engine_options={"prompt": prompt_form})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    fast = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    ref = [o.outputs[0] for o in reference_llm.generate(PROMPTS, params)]
    assert_answers_close(fast, ref, 0.15)


def test_decode_rows_run_as_one_graph(production, monkeypatch):
    forward = production.engine.runner.forward_pass
    layer_by_layer = []
    real = forward._layers
    monkeypatch.setattr(forward, "_layers", lambda linear, hidden, *a: layer_by_layer.append(
        hidden.shape[0]) or real(linear, hidden, *a))
    _decode_logits(production, list(range(7, 47)), 10)
    assert layer_by_layer == [10]  # the prefill only: each decode step was one graph call


def test_a_sequences_tokens_do_not_depend_on_its_batch(production, monkeypatch):
    from backend_engine.attention.metadata import AttentionMetadata

    mixed = []  # a small step budget: long prompts prefill in chunks beside others' decodes
    split = AttentionMetadata.prefill_part
    monkeypatch.setattr(AttentionMetadata, "prefill_part",
                        lambda meta: mixed.append(meta.num_decode_tokens) or split(meta))
    assert production.engine.pool.reset_prefix_cache()  # earlier tests' prompts: no cache hits
    together = [o.outputs[0].token_ids for o in production.generate(PROMPTS, GREEDY)]
    assert mixed  # steps with decode rows (the graph) and prefill chunks (layer by layer)
    alone = [production.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone


def test_no_step_recompiles_after_start_up(production):
    from torch._dynamo.utils import counters

    before = sum(counters["stats"].values())
    production.generate(PROMPTS, GREEDY)  # prefills of 1-64 rows, decodes of 1-4, mixed steps
    production.generate(PROMPTS[1], GREEDY)
    assert sum(counters["stats"].values()) == before


def test_decode_rows_over_other_caches_run_layer_by_layer(production, monkeypatch):
    runner = production.engine.runner
    forward = runner.forward_pass
    layer_by_layer = []
    real = forward._layers
    monkeypatch.setattr(forward, "_layers", lambda linear, hidden, *a: layer_by_layer.append(
        hidden.shape[0]) or real(linear, hidden, *a))
    other = [(torch.zeros_like(k[:4]), torch.zeros_like(v[:4])) for k, v in runner.kv_caches]
    inputs = runner.prepare(StepBatch([[5]], [3], [4], [[2]]))
    with torch.inference_mode():
        hidden = forward(inputs.input_ids, inputs.positions, other, inputs.meta)
    assert layer_by_layer == [1] and torch.isfinite(hidden).all()
    written = runner.block_size * 2 + 3  # block 2, position 3: the new K row
    assert other[0][0].view(-1, *other[0][0].shape[2:])[written].abs().sum() > 0


def test_enforce_eager_compiles_nothing():
    llm = LLM("tiny-random", num_kv_blocks=16, quantization="int8", enforce_eager=True)
    forward = llm.engine.runner.forward_pass
    assert not forward.plan.compiled and forward.decode_step is None
    assert set(forward.layers.values()) == {None}
    assert "eager" in forward.describe()


def test_a_decode_step_that_cannot_compile_runs_layer_by_layer(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(decode_step, "paged_decode", broken)
    llm = LLM("tiny-random", **PRODUCTION)
    forward = llm.engine.runner.forward_pass
    assert forward.decode_step is None and set(forward.layers.values()) != {None}
    assert "decode step unavailable" in forward.describe()
    assert llm.generate("hello", GREEDY)[0].outputs[0].token_ids


def test_layers_that_cannot_compile_run_eager(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cl, "_shared", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken)
    llm = LLM("tiny-random", **PRODUCTION)
    forward = llm.engine.runner.forward_pass
    assert set(forward.layers.values()) == {None} and forward.decode_step is None
    assert llm.generate("hello", GREEDY)[0].outputs[0].token_ids


def test_a_cpp_wrapper_that_cannot_compile_leaves_the_python_one_with_the_same_logits(
        monkeypatch):
    from torch._inductor.codecache import CppWrapperCodeCache

    tokens = list(range(7, 47))
    cpp = LLM("tiny-random", **PRODUCTION)
    assert cpp.engine.runner.forward_pass.decode_step.cpp_wrapper
    expected = _decode_logits(cpp, tokens, 10)

    def broken(*args, **kwargs):
        raise RuntimeError("no Python headers")

    monkeypatch.setattr(CppWrapperCodeCache, "load_pybinding", broken)
    # another pool size (a constant of the graph): compiled, or loaded from Inductor's cache,
    # afresh in this process
    llm = LLM("tiny-random", num_kv_blocks=48)
    step = llm.engine.runner.forward_pass.decode_step
    assert step is not None and not step.cpp_wrapper
    # the same kernels in the same order: the same bits
    assert torch.equal(_decode_logits(llm, tokens, 10), expected)


# int8 weights on cpu-amx: the decode step with its weights frozen into Inductor's GEMM templates

@pytest.fixture(scope="module")
def template_llm():
    llm = LLM("tiny-random", num_kv_blocks=256, quantization="int8", max_num_batched_tokens=64,
              engine_options={"device_class": "cpu-amx"})
    step = llm.engine.runner.forward_pass.decode_step
    if (step is None or not step.templates) and \
            torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("Inductor builds no int8 GEMM template on a CPU without AVX512")
    assert step is not None and step.templates, "Inductor could not build the template step"
    return llm


def test_a_template_decode_step_gives_the_kernels_logits(template_llm, monkeypatch):
    tokens = list(range(7, 47))  # decode rows cross block boundaries; one row a step (padded)
    templates = _decode_logits(template_llm, tokens, 10)
    _eager(monkeypatch, template_llm)
    eager = _decode_logits(template_llm, tokens, 10)
    # the template and torch's kernel round differently: about one bf16 step of the largest
    torch.testing.assert_close(templates, eager, atol=1e-2 * eager.abs().max().item(), rtol=0)


def test_a_template_decode_step_keeps_a_sequences_tokens_whatever_its_batch(template_llm):
    from torch._dynamo.utils import counters

    before = sum(counters["stats"].values())
    together = [o.outputs[0].token_ids for o in template_llm.generate(PROMPTS, GREEDY)]
    alone = [template_llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone  # one row (padded to two) and four: the same graph, the same bits
    assert sum(counters["stats"].values()) == before  # and nothing compiled again


def test_a_template_decode_step_holds_its_own_weights(template_llm):
    """Inductor's cache key does not cover frozen constants: the graph's key carries a digest
    of the weights, so other weights of the same shapes get a graph of their own."""
    from backend_engine.accel.cpu import kernels as cpu
    from backend_engine.quant.formats import quantize_int8

    forward = template_llm.engine.runner.forward_pass
    model, first = forward.model, forward.decode_step
    layers = [list(layer) for layer in first._layers]
    gen = torch.Generator().manual_seed(7)
    for layer in layers:
        for i in (1, 4, 6, 7):
            layer[i] = cpu.prepare_int8(quantize_int8(torch.randn(*layer[i].shape,
                                                                  generator=gen)))
    other = {templates: decode_step.DecodeStep(
        tuple(map(tuple, layers)), model.norm, model.eps, model.num_heads, model.num_kv_heads,
        model.head_dim, model.scale, forward.linear, first.structure, templates=templates)
        for templates in (True, False)}
    caches = template_llm.engine.runner.kv_caches
    for step in other.values():
        assert step.warm_up(caches, model.embed.shape[1], model.rotary.cos_sin,
                              model.dtype)
    with torch.inference_mode():  # inference tensors, as the engine's steps (guarded)
        hidden = torch.randn(3, model.embed.shape[1], generator=gen)
        inputs = (*model.rotary.cos_sin(torch.tensor([3, 4, 5])), caches,
                  [(torch.tensor([40, 41, 42]), torch.tensor([[2, 3], [2, 3], [2, 3]]),
                    torch.tensor([4, 5, 6]))])
        out = {name: step(hidden.clone(), *inputs) for name, step in
               (("first", first), ("templates", other[True]), ("kernel", other[False]))}
    torch.testing.assert_close(out["templates"], out["kernel"], atol=2e-2, rtol=0)
    assert (out["templates"] - out["first"]).abs().max() > 0.1


def test_a_template_step_that_cannot_build_runs_with_the_kernels(monkeypatch):
    def broken(self, *args):
        raise RuntimeError("no GEMM template here")

    monkeypatch.setattr(decode_step.TemplateStep, "forward", broken)
    llm = LLM("tiny-random", quantization="int8", engine_options={"device_class": "cpu-amx"},
              **PRODUCTION)
    forward = llm.engine.runner.forward_pass
    assert forward.decode_step is not None and not forward.decode_step.templates
    assert "decode templates unavailable" in forward.describe()
    assert llm.generate("hello", GREEDY)[0].outputs[0].token_ids


def test_only_an_all_int8_model_takes_the_template_step():
    llm = LLM("tiny-random", num_kv_blocks=16, quantization="int4", enforce_eager=True,
              engine_options={"device_class": "cpu-amx"})
    assert llm.engine.runner.forward_pass.plan.decode["int8"] == "kernel"


def test_a_family_with_head_norms_takes_the_compiled_plan_and_answers_as_its_reference_path():
    """Qwen3's q/k head norms ride through the compiled layers and the decode step."""
    llm = LLM("tiny-random-qwen3", **PRODUCTION)
    forward = llm.engine.runner.forward_pass
    assert forward.decode_step is not None and all(forward.layers.values())
    reference = LLM("tiny-random-qwen3", engine_options={"plan": "reference"}, **PRODUCTION)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    fast = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    ref = [o.outputs[0] for o in reference.generate(PROMPTS, params)]
    assert_answers_close(fast, ref, 1e-3)
