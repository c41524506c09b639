"""Gemma 3 in the compiled decode step (accel/decode_step.py): its own layer and norm, each layer's
rotary kind and window baked in, sliding layers reading only their window's blocks; the decode
rows' answers are the eager layers' (which tests/backend_engine/test_hybrid_kv_cache.py holds to
transformers), with KV cache groups (one pool written by every layer) and with one masked
group (a pool per layer); the stores write the pool in place."""

import math
import random
import re

import pytest
import torch

from backend_engine.accel import decode_step
from backend_engine.llm import LLM
from backend_engine.sampling_params import SamplingParams
from tests.backend_engine.helpers import assert_answers_close

MODEL = "tiny-random-gemma3"  # layers: full, sliding (window 16), full; block size 16
PRODUCTION = dict(num_kv_blocks=256, max_num_batched_tokens=64)
rng = random.Random(7)
# contexts from under one window to several windows long, decoded past block boundaries
PROMPTS = [[rng.randrange(1000, 40000) for _ in range(n)] for n in (5, 40, 90, 131)]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)


# KV cache groups (one pool written by every layer), or one masked group (a pool per layer)
LAYOUTS = {"groups": {}, "masked": dict(disable_hybrid_kv_cache_manager=True)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def gemma(request):
    return LLM(MODEL, **PRODUCTION, **LAYOUTS[request.param])


def test_gemma3_decode_rows_take_the_compiled_step(gemma):
    forward = gemma.engine.runner.forward_pass
    assert forward.plan.compiled and forward.decode_step is not None
    assert forward.decode_step.cpp_wrapper  # the C++ wrapper calls the store op too
    structure = forward.decode_step.structure
    assert [window for _, window, _, _ in structure.layers] == [0, 16, 0]
    assert [kind for kind, _, _, _ in structure.layers] == [0, 1, 0]
    groups = gemma.engine.runner.layer_groups  # [0, 2, 1] with groups, [0, 0, 0] masked
    assert set(structure.views) == set(zip(groups, [0, 16, 0]))


def test_the_compiled_step_answers_as_the_eager_layers(gemma, monkeypatch):
    """fp32 both ways: fused ops round apart by ulps only."""
    compiled = [o.outputs[0] for o in gemma.generate(PROMPTS, PARAMS)]
    assert gemma.engine.pool.reset_prefix_cache()
    monkeypatch.setattr(gemma.engine.runner.forward_pass, "decode_step", None)
    eager = [o.outputs[0] for o in gemma.generate(PROMPTS, PARAMS)]
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]
    assert_answers_close(compiled, eager, 1e-4)


def test_no_gemma3_step_recompiles_after_start_up(gemma):
    from torch._dynamo.utils import counters

    assert gemma.engine.pool.reset_prefix_cache()
    before = sum(counters["stats"].values())
    # 1-4 decode rows, tables narrower and wider than a window (one that cuts nothing returns
    # its input: the step's views must not alias then either)
    gemma.generate(PROMPTS[:1], PARAMS)
    gemma.generate(PROMPTS, PARAMS)
    assert sum(counters["stats"].values()) == before


@pytest.mark.parametrize("gemma", ["groups"], indirect=True)  # the layout with a shared pool
def test_the_step_writes_a_pool_shared_by_layers_in_place(gemma):
    """Each store writes its rows into the pool itself: the graph allocates nothing the size of
    a pool (functionalised index_copy_ into a pool several layers write made a new pool per
    store), and the warm-up's K/V rows of zeros land in the caches the engine reads."""
    from torch._inductor.utils import run_and_get_code

    forward, runner = gemma.engine.runner.forward_pass, gemma.engine.runner
    first, model = forward.decode_step, forward.model
    step = decode_step.DecodeStep(first._layers, model.norm, model.eps, model.num_heads,
                                  model.num_kv_heads, model.head_dim, model.scale,
                                  forward.linear, first.structure)  # Python wrapper: readable
    k_cache, v_cache = runner.kv_caches[0]
    pools = {id(k) for k, _ in runner.kv_caches}
    pointers = [(k.data_ptr(), v.data_ptr()) for k, v in runner.kv_caches]
    assert gemma.engine.pool.reset_prefix_cache()  # block 0 holds nothing to keep
    with torch.inference_mode():
        k_cache[0, :3].fill_(1.0)
        ok, codes = run_and_get_code(step.warm_up, runner.kv_caches, model.embed.shape[1],
                                     model.rotary.cos_sin, model.dtype)
    assert ok and len(codes) == 2  # one row, several rows
    allocated = [math.prod(int(d) for d in shape.split(",") if d.strip())
                 for shape in re.findall(r"empty_strided_cpu\(\(([\d, ]*)\)", "\n".join(codes))]
    assert allocated and max(allocated) < k_cache.numel() // 4
    assert len(pools) == 1
    assert [(k.data_ptr(), v.data_ptr()) for k, v in runner.kv_caches] == pointers
    assert not k_cache[0, :3].any()  # the warm-up's rows of zeros, written by the graph


def test_a_bf16_gemma3_compiles_its_decode_step_too():
    """Gemma keeps its norms in fp32 while the model computes in bf16: the step is warmed up
    over hidden states of the compute dtype (warmed up in the norms' fp32, it failed and the
    replica decoded layer by layer)."""
    llm = LLM(MODEL, **PRODUCTION, dtype="bfloat16")
    forward = llm.engine.runner.forward_pass
    assert forward.model.norm.dtype == torch.float32 and forward.model.dtype == torch.bfloat16
    assert forward.decode_step is not None and "decode step" not in forward.describe()
    compiled = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]
    assert llm.engine.pool.reset_prefix_cache()
    forward.decode_step = None
    eager = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]
    assert_answers_close(compiled, eager, 0.1)  # bf16: fused ops round apart (the plan's bound)
