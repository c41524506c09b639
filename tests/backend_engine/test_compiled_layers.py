"""Compiled layers (models/compiled_layers.py) and the compiled decode step (models/decode_graph.py):
the eager model's logits, every row through the same code whatever its step holds (a sequence's
tokens do not depend on its batch), no recompiles after start-up, eager when compiling fails,
and the engine's choice of when to compile."""

import pytest
import torch

from backend_engine.llm import LLM
from backend_engine.models import compiled_layers as cl
from backend_engine.sampling_params import SamplingParams

PROMPTS = ["a long way " * 40, "short", "x y z " * 90, "the cat sat on the mat " * 5]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _logits(llm, token_ids: list[int]) -> torch.Tensor:
    from backend_engine.step_batch import StepBatch  # one prefill step, no sampling

    runner = llm.engine.runner
    blocks = list(range(-(-len(token_ids) // runner.block_size)))
    batch = StepBatch(token_ids=[token_ids], num_computed_tokens=[0], block_ids=[blocks],
                      num_tokens=[len(token_ids)])
    return runner.forward_batch(batch)[1]


@pytest.mark.parametrize("quantization,atol", [(None, 1e-4), ("int8", 2e-2)])
def test_compiled_layers_give_the_eager_logits(quantization, atol):
    llm = LLM("tiny-random", num_kv_blocks=64, quantization=quantization, compile_layers="on")
    model = llm.engine.runner.model
    assert model.compiled is not None
    tokens = list(range(5, 45))
    compiled = _logits(llm, tokens)
    model.compiled = None
    eager = _logits(llm, tokens)
    torch.testing.assert_close(compiled, eager, atol=atol, rtol=0)


def _decode_logits(llm, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Logits of a prefill of tokens[:prompt_len], then of one decode step per further token
    (teacher-forced), each step writing its K/V and reading the ones before."""
    from backend_engine.step_batch import StepBatch

    runner = llm.engine.runner
    blocks = list(range(-(-len(tokens) // runner.block_size)))
    prefill = StepBatch([tokens[:prompt_len]], [0], [prompt_len], [blocks])
    logits = [runner.forward_batch(prefill)[1][-1]]
    for n in range(prompt_len, len(tokens)):
        step = StepBatch([[tokens[n]]], [n], [n + 1], [blocks])
        logits.append(runner.forward_batch(step)[1][0])
    return torch.stack(logits)


def test_decode_rows_run_as_one_graph_with_the_eager_logits(monkeypatch):
    llm = LLM("tiny-random", num_kv_blocks=64, compile_layers="on")
    model = llm.engine.runner.model
    assert model.decode_graph is not None and model.decode_graph.cpp_wrapper  # on CPU
    layer_by_layer = []
    real = model._layers
    monkeypatch.setattr(model, "_layers", lambda hidden, *a: layer_by_layer.append(
        hidden.shape[0]) or real(hidden, *a))
    tokens = list(range(7, 47))  # 3 blocks of 16: decode rows cross block boundaries
    graph = _decode_logits(llm, tokens, 10)
    assert layer_by_layer == [10]  # the prefill only: each decode step was one graph call
    model.decode_graph = model.compiled = None
    eager = _decode_logits(llm, tokens, 10)
    torch.testing.assert_close(graph, eager, atol=1e-4, rtol=0)


def test_decode_rows_over_other_caches_run_layer_by_layer(monkeypatch):
    from backend_engine.step_batch import StepBatch

    llm = LLM("tiny-random", num_kv_blocks=64, compile_layers="on")
    runner, model = llm.engine.runner, llm.engine.runner.model
    layer_by_layer = []
    real = model._layers
    monkeypatch.setattr(model, "_layers", lambda hidden, *a: layer_by_layer.append(
        hidden.shape[0]) or real(hidden, *a))
    other = [(torch.zeros_like(k[:4]), torch.zeros_like(v[:4])) for k, v in runner.kv_caches]
    inputs = runner.prepare(StepBatch([[5]], [3], [4], [[2]]))
    with torch.inference_mode():
        hidden = model.forward(inputs.input_ids, inputs.positions, other, inputs.meta)
    assert layer_by_layer == [1] and torch.isfinite(hidden).all()
    written = runner.block_size * 2 + 3  # block 2, position 3: the new K row
    assert other[0][0].view(-1, *other[0][0].shape[2:])[written].abs().sum() > 0


def test_a_decode_step_that_cannot_compile_runs_layer_by_layer(monkeypatch):
    from backend_engine.models import decode_graph

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(decode_graph, "paged_decode", broken)
    llm = LLM("tiny-random", num_kv_blocks=64, compile_layers="on")
    model = llm.engine.runner.model
    assert model.decode_graph is None and model.compiled is not None
    assert llm.generate("hello", GREEDY)[0].outputs[0].token_ids


def test_a_cpp_wrapper_that_cannot_compile_leaves_the_python_one_with_the_same_logits(
        monkeypatch):
    from torch._inductor.codecache import CppWrapperCodeCache

    tokens = list(range(7, 47))
    cpp = LLM("tiny-random", num_kv_blocks=64, compile_layers="on")
    assert cpp.engine.runner.model.decode_graph.cpp_wrapper
    expected = _decode_logits(cpp, tokens, 10)
    monkeypatch.setattr(CppWrapperCodeCache, "load_pybinding", _broken)
    # another pool size (a constant of the graph): compiled, or loaded from Inductor's cache,
    # afresh in this process
    llm = LLM("tiny-random", num_kv_blocks=48, compile_layers="on")
    graph = llm.engine.runner.model.decode_graph
    assert graph is not None and not graph.cpp_wrapper
    # the same kernels in the same order: the same bits
    assert torch.equal(_decode_logits(llm, tokens, 10), expected)


def test_a_sequences_tokens_do_not_depend_on_its_batch(monkeypatch):
    from backend_engine.attention.metadata import AttentionMetadata

    # a small step budget: long prompts prefill in chunks beside the others' decode rows
    llm = LLM("tiny-random", num_kv_blocks=256, quantization="int8", compile_layers="on",
              max_num_batched_tokens=64)
    mixed = []
    split = AttentionMetadata.prefill_part
    monkeypatch.setattr(AttentionMetadata, "prefill_part",
                        lambda meta: mixed.append(meta.num_decode_tokens) or split(meta))
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert mixed  # steps with decode rows (the graph) and prefill chunks (layer by layer)
    alone = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone


def test_no_step_recompiles_after_start_up():
    from torch._dynamo.utils import counters

    llm = LLM("tiny-random", num_kv_blocks=256, dtype="bfloat16", compile_layers="on")
    before = sum(counters["stats"].values())
    llm.generate(PROMPTS, GREEDY)  # prefills of 1-200 rows, decodes of 1-4, mixed steps
    llm.generate(PROMPTS[1], GREEDY)
    assert sum(counters["stats"].values()) == before


def test_layers_that_cannot_compile_run_eager(monkeypatch):
    monkeypatch.setattr(cl, "_shared", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: _broken)
    llm = LLM("tiny-random", num_kv_blocks=64, compile_layers="on")
    assert llm.engine.runner.model.compiled is None  # warm-up failed: eager layers
    assert llm.generate("hello", GREEDY)[0].outputs[0].token_ids


def _broken(*args, **kwargs):
    raise RuntimeError("no C++ compiler")


def test_when_layers_compile_by_default():
    tiny = LLM("tiny-random", num_kv_blocks=16, quantization="int8")
    assert tiny.engine.runner.model.compiled is None  # tiny K/V: auto leaves it eager
    off = LLM("tiny-random", num_kv_blocks=16, compile_layers="off")
    assert off.engine.runner.model.compiled is None


def test_a_bad_compile_layers_value_is_refused():
    from backend_engine.config import EngineConfig

    with pytest.raises(ValueError, match="compile_layers"):
        EngineConfig(compile_layers="sometimes").validate()


def test_a_quantised_real_model_compiles_by_default_and_fp32_does_not():
    # the kernels' decode step: frozen (auto on AMX CPUs) it compiles for minutes with a cold
    # Inductor cache; its tests above run on the tiny model
    int8 = LLM("default", num_kv_blocks=64, quantization="int8", dtype="bfloat16",
               quantized_decode="kernel")
    assert int8.engine.runner.model.compiled is not None
    assert int8.engine.runner.model.decode_graph is not None
    assert int8.engine.runner.attention.compiled is None  # decode rows never reach it
    answer = int8.generate("The capital of France is", GREEDY)[0].outputs[0].text
    assert answer.strip()
    fp32 = LLM("default", num_kv_blocks=16, dtype="float32")
    assert fp32.engine.runner.model.compiled is None
    assert fp32.engine.runner.attention.compiled is not None  # eager layers, compiled attention


# --quantized-decode template: the weights frozen into the decode step (Inductor's GEMM templates)

@pytest.fixture(scope="module")
def frozen_llm():
    llm = LLM("tiny-random", num_kv_blocks=256, quantization="int8", compile_layers="on",
              quantized_decode="template", max_num_batched_tokens=64)
    graph = llm.engine.runner.model.decode_graph
    if (graph is None or not graph.frozen) and \
            torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("measured and tested on AVX512/AMX CPUs; Inductor's template not built here")
    assert graph is not None and graph.frozen, "Inductor could not freeze the decode step here"
    return llm


def test_a_frozen_decode_step_gives_the_eager_logits(frozen_llm, monkeypatch):
    model = frozen_llm.engine.runner.model
    tokens = list(range(7, 47))  # decode rows cross block boundaries; one row a step (padded)
    frozen = _decode_logits(frozen_llm, tokens, 10)
    monkeypatch.setattr(model, "decode_graph", None)
    monkeypatch.setattr(model, "compiled", None)
    eager = _decode_logits(frozen_llm, tokens, 10)
    # the template and torch's kernel round differently: about one bf16 step of the largest
    torch.testing.assert_close(frozen, eager, atol=1e-2 * eager.abs().max().item(), rtol=0)


def test_a_frozen_decode_step_keeps_a_sequences_tokens_whatever_its_batch(frozen_llm):
    from torch._dynamo.utils import counters

    before = sum(counters["stats"].values())
    together = [o.outputs[0].token_ids for o in frozen_llm.generate(PROMPTS, GREEDY)]
    alone = [frozen_llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone  # one row (padded to two) and four: the same graph, the same bits
    assert sum(counters["stats"].values()) == before  # and nothing compiled again


def test_a_frozen_decode_step_holds_its_own_weights(frozen_llm):
    """Inductor's cache key does not cover frozen constants: the graph's key carries a digest
    of the weights, so other weights of the same shapes get a graph of their own."""
    from backend_engine.models.decode_graph import DecodeGraph
    from backend_engine.quant import cpu
    from backend_engine.quant.formats import quantize_int8

    model = frozen_llm.engine.runner.model
    first = model.decode_graph
    layers = [list(layer) for layer in first._layers]
    gen = torch.Generator().manual_seed(7)
    for layer in layers:
        for i in (1, 3, 5, 6):
            layer[i] = cpu.prepare_int8(quantize_int8(torch.randn(*layer[i].shape, generator=gen)))
    other = {frozen: DecodeGraph(tuple(map(tuple, layers)), model.norm, model.eps,
                                 model.num_heads, model.num_kv_heads, model.head_dim,
                                 model.scale, frozen=frozen) for frozen in (True, False)}
    caches = frozen_llm.engine.runner.kv_caches
    for graph in other.values():
        assert graph.warm_up(caches, model.embed.shape[1], model.rotary.cos_sin)
    with torch.inference_mode():  # inference tensors, as the engine's steps (guarded)
        hidden = torch.randn(3, model.embed.shape[1], generator=gen)
        step = (*model.rotary.cos_sin(torch.tensor([3, 4, 5])), caches,
                torch.tensor([40, 41, 42]), torch.tensor([[2, 3], [2, 3], [2, 3]]),
                torch.tensor([4, 5, 6]))
        out = {name: graph(hidden.clone(), *step) for name, graph in
               (("first", first), ("frozen", other[True]), ("kernel", other[False]))}
    # a seeded input: from the global RNG (test order) AVX512's micro-kernel once missed 2e-2 by
    # one element in 192 (0.0235); with this one the largest difference is ~0.004
    torch.testing.assert_close(out["frozen"], out["kernel"], atol=2e-2, rtol=0)
    assert (out["frozen"] - out["first"]).abs().max() > 0.1


def test_which_decode_step_freezes_its_weights(frozen_llm, monkeypatch):
    from backend_engine.models import decode_graph

    layers = frozen_llm.engine.runner.model.decode_graph._layers  # tiny int8 weights
    monkeypatch.setattr("backend_engine.dtype.cpu_has_amx", lambda: True)
    assert not decode_graph.use_frozen("auto", layers)  # tiny weights do not pay the compile
    assert decode_graph.use_frozen("template", layers)
    assert not decode_graph.use_frozen("kernel", layers)
    monkeypatch.setattr("backend_engine.quant.cpu_template.MIN_ELEMENTS", 1)
    assert decode_graph.use_frozen("auto", layers)
    monkeypatch.setattr("backend_engine.dtype.cpu_has_amx", lambda: False)
    assert not decode_graph.use_frozen("auto", layers)  # measured on AMX only
    norm, w = torch.ones(4), torch.zeros(4, 4)
    fp = ((norm, w, None, w, norm, torch.zeros(8, 4), w),)
    assert not decode_graph.use_frozen("template", fp)  # fp weights: nothing to freeze


def test_a_decode_step_that_cannot_freeze_runs_with_the_kernels(monkeypatch):
    from backend_engine.models import decode_graph

    def broken(self, *args):
        raise RuntimeError("no GEMM template here")

    monkeypatch.setattr(decode_graph.FrozenStep, "forward", broken)
    llm = LLM("tiny-random", num_kv_blocks=64, quantization="int8", compile_layers="on",
              quantized_decode="template")
    graph = llm.engine.runner.model.decode_graph
    assert graph is not None and not graph.frozen
    assert llm.generate("hello", GREEDY)[0].outputs[0].token_ids


def test_a_bad_quantized_decode_value_is_refused():
    from backend_engine.config import EngineConfig

    with pytest.raises(ValueError, match="quantized_decode"):
        EngineConfig(quantized_decode="sometimes").validate()


def test_frozen_int4_weights_keep_a_sequences_tokens_whatever_its_batch():
    llm = LLM("tiny-random", num_kv_blocks=256, quantization="int4", compile_layers="on",
              quantized_decode="template", max_num_batched_tokens=64)
    graph = llm.engine.runner.model.decode_graph
    if graph is None or not graph.frozen:
        pytest.skip("Inductor has no int4 GEMM template on this CPU (AVX512 and AMX only)")
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    alone = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone
