"""Compiled layers (models/compiled_layers.py): the eager model's logits, every step through the
same code (a sequence's tokens do not depend on its batch), no recompiles after start-up, eager
when compiling fails, and the engine's choice of when to compile."""

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


def test_a_sequences_tokens_do_not_depend_on_its_batch():
    llm = LLM("tiny-random", num_kv_blocks=256, quantization="int8", compile_layers="on")
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
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
    answer = int8.generate("The capital of France is", GREEDY)[0].outputs[0].text
    assert answer.strip()
    fp32 = LLM("default", num_kv_blocks=16, dtype="float32")
    assert fp32.engine.runner.model.compiled is None
