"""The same greedy tokens whatever the batching, chunking, caching or memory pressure: the
default model unquantised, and the tiny model with int8 and int4 weights (prompt tokens in a
prompt form of their own, `tiles`, generated tokens through the weight-only kernels)."""

import pytest

from backend_engine.llm import LLM
from backend_engine.sampling_params import SamplingParams
from tests.backend_engine.helpers import assert_no_leaks

SYSTEM = ("You are a meticulous assistant. Answer briefly and cite the rule you used. " * 4)
PROMPTS = [SYSTEM + q for q in ("What is 2+2?", "Name a colour.", "Spell 'cat'.",
                                "Is water wet?", "Count to three.", "Say hello.")]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


# quantised: prompt tokens through the tiles, generated ones through the kernel
CASES = [("default", "none"), ("tiny-random", "int8"), ("tiny-random", "int4")]


@pytest.fixture(scope="module", params=CASES, ids=["default", "tiny-int8", "tiny-int4"])
def case(request):
    return request.param


@pytest.fixture(scope="module")
def base_llm(case, request):
    if case == ("default", "none"):
        return request.getfixturevalue("default_llm")
    llm = _llm(case, num_kv_blocks=512)
    assert llm.engine.runner.forward_pass.prompt_linear is not None  # a form of their own
    return llm


def _llm(case, **kwargs):
    # a fixed token budget: the latency target sizes chunks from measured step times, and a
    # loaded machine's chunks would split prompts elsewhere than the case under test does
    kwargs.setdefault("target_itl_ms", 0)
    if case[1] != "none":
        kwargs["engine_options"] = {"prompt": "tiles"}
    return LLM(case[0], enforce_eager=True, quantization=case[1], **kwargs)


@pytest.fixture(scope="module")
def reference(base_llm):
    return [o.outputs[0].token_ids for o in base_llm.generate(PROMPTS, PARAMS)]


def _tokens(llm):
    outs = llm.generate(PROMPTS, PARAMS)
    assert_no_leaks(llm.engine)
    return [o.outputs[0].token_ids for o in outs]


def test_one_at_a_time_matches_mixed_batch(base_llm, reference):
    singles = [base_llm.generate(p, PARAMS)[0].outputs[0].token_ids for p in PROMPTS]
    assert singles == reference


def test_prefix_cache_hits_are_counted_and_do_not_change_output(base_llm, reference):
    engine = base_llm.engine
    before_hits = engine.stats.prefix_cache_hits
    outs = base_llm.generate(PROMPTS, PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == reference
    # every prompt was seen before, and its generated tokens filled the block its prompt ends
    # in: each hits every token but the last (the block past its whole ones partly)
    expected = [len(o.prompt_token_ids) - 1 for o in outs]
    assert [o.num_cached_tokens for o in outs] == expected
    assert engine.stats.prefix_cache_hits - before_hits == sum(expected)


def test_caching_off_gives_same_tokens(case, reference):
    llm = _llm(case, num_kv_blocks=256, enable_prefix_caching=False)
    assert _tokens(llm) == reference
    assert llm.engine.stats.prefix_cache_hits == 0


def test_odd_chunked_prefill_gives_same_tokens(case, reference):
    llm = _llm(case, num_kv_blocks=256, max_num_batched_tokens=37)
    assert _tokens(llm) == reference


def test_preemption_under_a_tiny_pool_gives_same_tokens(case, reference):
    # 6 prompts of ~90 tokens + 24 outputs need ~42 blocks at once; 16 forces preemption
    llm = _llm(case, num_kv_blocks=16, max_num_batched_tokens=64)
    assert _tokens(llm) == reference
    assert llm.engine.stats.preemptions > 0
