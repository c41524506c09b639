"""Every model family against transformers' own implementation of it, on a tiny random-weight
config of each (backend_engine/model_loader.py: TINY_CONFIGS): transformers' greedy tokens
exactly, and their logprobs within LOGPROB_ATOL (fp32 both sides), through the engine's
features: continuous batching, prefix caching (every prompt served twice, the second time from
the cache), chunked prefill beside decodes, preemption under a tiny KV pool, speculative
decoding (a draft model of the family; the n-gram proposer's drafts go through the same
verification, tests/backend_engine/test_spec_decode.py). Quantised weights (int8, int4) through the plan's forms against the
engine's reference path (every weight dequantised, F.linear), whose fp32 answers are the ones
checked against transformers. Tensor parallelism: tests/backend_engine/distributed."""

from __future__ import annotations

import random

import pytest

from backend_engine.llm import LLM
from backend_engine.sampling_params import SamplingParams
from tests.backend_engine.helpers import (assert_answers_close, assert_no_leaks,
                                          transformers_greedy)

FAMILIES = ["tiny-random-llama", "tiny-random-qwen2", "tiny-random-mistral", "tiny-random-qwen3",
            "tiny-random-phi3", "tiny-random-gemma3", "tiny-random-qwen3_moe",
            "tiny-random-mixtral"]
FEATURES = {
    "batched": {},
    "chunked": dict(max_num_batched_tokens=16),  # prompts in chunks, beside others' decodes
    "preempted": dict(num_kv_blocks=8),  # 4 sequences of 4 blocks each: preempted, recomputed
    # the family's own tiny model drafts for itself: every step verifies 3 drafted tokens
    "draft": dict(speculative_method="draft", num_speculative_tokens=3),
}
NEW_TOKENS = 12
LOGPROB_ATOL = 1e-3  # fp32 both sides; fused qkv and paged attention sum in another order (as test_hf_parity)
rng = random.Random(3)
SHARED = [rng.randrange(1000, 40000) for _ in range(33)]  # 2 full blocks: a prefix cache hit
PROMPTS = [SHARED + [rng.randrange(1000, 40000) for _ in range(n)] for n in (4, 11)] \
    + [[11, 12, 13, 14] * 8, [rng.randrange(1000, 40000) for _ in range(7)]]
QUANT_TOLERANCE = 0.15  # the plan's bound (tests/backend_engine/accel)
# A MoE router ranks the experts: where a quantised form moves a row's k-th and (k+1)-th expert
# past each other (gaps under 0.02 measured), that row runs another expert from there on. int4
# prompt rows under int8_sums (int4 requantised to int8, cpu-avx512) flip 2-5 of ~150 routings
# on these prompts and move later logprobs by up to 0.19 (tokens part only at a near-tie).
MOE_FAMILIES = ("tiny-random-qwen3_moe", "tiny-random-mixtral")
MOE_QUANT_TOLERANCE = 0.25
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def transformers_answers(family):
    return transformers_greedy(family, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("feature", FEATURES)
def test_greedy_answers_are_transformers(family, transformers_answers, feature):
    settings = {"num_kv_blocks": 64, **FEATURES[feature]}
    if feature == "draft":
        settings["draft_model"] = family
    if feature == "preempted" and family == "tiny-random-gemma3":
        settings["num_kv_blocks"] = 3 * 8  # the same bytes: a block of its KV cache groups
        #   spans one of its three layers (backend_engine/kv_cache_groups.py)
    llm = LLM(family, enforce_eager=True, dtype="float32", target_itl_ms=0, **settings)
    first = llm.generate(PROMPTS, GREEDY)
    again = llm.generate(PROMPTS, GREEDY)  # whole prompts cached now
    assert_no_leaks(llm.engine)
    if feature != "preempted":
        assert all(o.num_cached_tokens > 0 for o in again[:2])
    if feature == "preempted":
        assert llm.engine.stats.preemptions > 0
    if feature == "draft":
        assert llm.engine.spec.stats.accepted_tokens > 0
    for out, (tokens, logprobs) in zip(first + again, transformers_answers * 2):
        assert out.outputs[0].token_ids == tokens, (family, feature)
        ours = [lp.logprob for lp in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < LOGPROB_ATOL


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantised_weights_answer_as_the_reference_path(family, quantization):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    fast, reference = (
        [o.outputs[0] for o in LLM(family, enforce_eager=True, quantization=quantization,
                                   num_kv_blocks=64, target_itl_ms=0,
                                   engine_options=options).generate(PROMPTS, params)]
        for options in ({}, {"plan": "reference"}))
    assert_answers_close(fast, reference,
                         MOE_QUANT_TOLERANCE if family in MOE_FAMILIES else QUANT_TOLERANCE)
