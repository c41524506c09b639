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
    assert model.decode_graph is not None
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
    int8 = LLM("default", num_kv_blocks=64, quantization="int8", dtype="bfloat16")
    assert int8.engine.runner.model.compiled is not None
    assert int8.engine.runner.model.decode_graph is not None
    assert int8.engine.runner.attention.compiled is None  # decode rows never reach it
    answer = int8.generate("The capital of France is", GREEDY)[0].outputs[0].text
    assert answer.strip()
    fp32 = LLM("default", num_kv_blocks=16, dtype="float32")
    assert fp32.engine.runner.model.compiled is None
    assert fp32.engine.runner.attention.compiled is not None  # eager layers, compiled attention
