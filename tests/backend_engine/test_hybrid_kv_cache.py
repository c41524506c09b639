"""KV cache groups (backend_engine/kv_cache_groups.py, hybrid_kv_cache_manager.py): Gemma 3's
sliding-window layers give back the blocks that left their window, and its answers stay
transformers' own on sequences several windows long, through prefix caching (a cached prefix
longer than the window), chunked prefill, preemption and continuous batching; the router sees the
same blocks as without groups; nothing leaks."""

from __future__ import annotations

import random

import pytest

from backend_engine.block_pool import BlockPool
from backend_engine.config import EngineConfig
from backend_engine.hybrid_kv_cache_manager import HybridKVCacheManager
from backend_engine.kv_block import NULL_BLOCK
from backend_engine.kv_cache_groups import (KVCacheGroupSpec, blocks_for_tokens,
                                            engine_kv_cache_groups, kv_cache_groups,
                                            sliding_blocks_bound)
from backend_engine.kv_cache_manager import KVCacheManager
from backend_engine.llm import LLM
from backend_engine.sampling_params import SamplingParams
from backend_engine.sequence import Sequence
from tests.backend_engine.helpers import assert_no_leaks, transformers_greedy

MODEL = "tiny-random-gemma3"  # layers: full, sliding (window 16), full; block size 16
WINDOW, BS = 16, 16
NEW_TOKENS = 24
LOGPROB_ATOL = 1e-3  # fp32 both sides, as tests/backend_engine/models/test_family_parity.py
rng = random.Random(5)
LONG = [rng.randrange(1000, 40000) for _ in range(90)]  # five and a half windows
PROMPTS = [LONG, LONG[:80] + [rng.randrange(1000, 40000) for _ in range(25)],
           [rng.randrange(1000, 40000) for _ in range(40)]]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
FEATURES = {
    "batched": {},
    "chunked": dict(max_num_batched_tokens=24),  # chunks across window and block boundaries
    # 3 sequences of up to 2 * 8 full-attention blocks + 4 sliding ones in 24 blocks
    "preempted": dict(num_kv_blocks=24, max_num_batched_tokens=32),
    "ngram": dict(speculative_method="ngram", num_speculative_tokens=3),  # drafts roll back
    "masked": dict(disable_hybrid_kv_cache_manager=True),  # one group: every block kept
}


def test_gemma3_270m_layers_make_six_groups_of_three():
    windows = [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]  # 5 sliding : 1 full
    groups = kv_cache_groups(windows)
    assert [g.sliding_window for g in groups] == [0] + [512] * 5
    assert groups[0].layers == (5, 11, 17) and groups[1].layers == (0, 1, 2)
    assert kv_cache_groups([0] * 30) == [KVCacheGroupSpec(tuple(range(30)))]
    # a 32k-token sequence: 2048 blocks of the full group, a window's worth of each sliding one
    assert blocks_for_tokens(groups, 32768, 16, 512) == 2048 + 5 * sliding_blocks_bound(512, 512, 16)


@pytest.mark.parametrize("setting, reason", [
    (dict(tensor_parallel_size=2), "tensor parallelism"),
    (dict(kv_offload_size_gb=1.0), "the KV offload tier"),
    (dict(kv_role="prefill"), "prefill/decode disaggregation"),
    (dict(disable_hybrid_kv_cache_manager=True), "--disable-hybrid-kv-cache-manager")])
def test_features_that_do_not_know_groups_keep_one_with_a_reason(setting, reason):
    windows = [0, 16, 0]
    assert len(engine_kv_cache_groups(windows, EngineConfig())[0]) == 3
    groups, why = engine_kv_cache_groups(windows, EngineConfig(**setting))
    assert groups == [KVCacheGroupSpec((0, 1, 2))] and why == reason


@pytest.fixture(scope="module")
def transformers_answers():
    return transformers_greedy(MODEL, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("feature", FEATURES)
def test_long_sequences_answer_as_transformers(transformers_answers, feature):
    llm = LLM(MODEL, enforce_eager=True, dtype="float32", target_itl_ms=0,
              **{"num_kv_blocks": 128, **FEATURES[feature]})
    hybrid = feature != "masked"
    assert isinstance(llm.engine.kv, HybridKVCacheManager) is hybrid
    first = llm.generate(PROMPTS, GREEDY)
    again = llm.generate(PROMPTS, GREEDY)  # from the cache: prefixes of 5 and 6 windows
    assert_no_leaks(llm.engine)
    if feature == "preempted":
        assert llm.engine.stats.preemptions > 0
    elif feature == "ngram":
        assert llm.engine.spec.stats.accepted_tokens > 0
    if feature == "masked":  # one group: whole blocks, then part of the next (partial_block.py)
        assert [o.num_cached_tokens for o in again] == [len(p) - 1 for p in PROMPTS]
    elif feature != "preempted":
        assert again[0].num_cached_tokens == 5 * BS and again[1].num_cached_tokens == 6 * BS
    for out, (tokens, logprobs) in zip(first + again, transformers_answers * 2):
        assert out.outputs[0].token_ids == tokens, feature
        ours = [lp.logprob for lp in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < LOGPROB_ATOL, feature


def test_forked_samples_and_quantised_rows_answer_as_the_masked_engine():
    """n = 2 forks the parent's blocks (the sliding group's window included); int8 runs prompt
    rows apart (AttentionMetadata.split_prompt_rows, per group): the same answers, bit for bit,
    as with every block kept."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2,
                            n=2)
    answers = []
    for disable in (False, True):
        llm = LLM(MODEL, enforce_eager=True, quantization="int8", target_itl_ms=0,
                  num_kv_blocks=128, max_num_batched_tokens=32,
                  disable_hybrid_kv_cache_manager=disable)
        outs = llm.generate(PROMPTS, params)
        assert_no_leaks(llm.engine)
        answers.append([[(c.token_ids, [lp.logprob for lp in c.logprobs]) for c in o.outputs]
                        for o in outs])
    assert answers[0] == answers[1]


def test_a_sliding_group_holds_a_window_however_long_the_sequence():
    llm = LLM(MODEL, enforce_eager=True, dtype="float32", target_itl_ms=0, num_kv_blocks=64,
              max_num_batched_tokens=32)
    engine, pool = llm.engine, llm.engine.pool
    engine.add_request("long", LONG, SamplingParams(temperature=0, max_tokens=60,
                                                    ignore_eos=True))
    bound = sliding_blocks_bound(WINDOW, 32, BS)
    longest = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            full, sliding = seq.block_table, seq.group_block_tables[1]
            held = [b for b in sliding if b is not NULL_BLOCK]
            assert len(held) <= bound
            assert all(b is NULL_BLOCK for b in sliding[:len(sliding) - len(held)])
            assert len(seq.group_block_tables[0]) == len(full) == len(sliding)
            assert pool.num_free_blocks == pool.num_blocks - 2 * len(full) - len(held)
            longest = max(longest, seq.num_computed_tokens)
    assert longest > 8 * WINDOW  # several windows, yet a window's worth held
    assert_no_leaks(engine)


def test_an_aborted_request_gives_back_every_group_s_blocks():
    llm = LLM(MODEL, enforce_eager=True, dtype="float32", target_itl_ms=0, num_kv_blocks=64,
              max_num_batched_tokens=32)
    engine = llm.engine
    engine.add_request("a", LONG, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True, n=2))
    for _ in range(6):
        engine.step()
    engine.abort_request("a")
    engine.abort_request("b")
    engine.step()
    assert_no_leaks(engine)


def test_the_router_sees_the_blocks_it_sees_without_groups():
    snapshots = []
    for disable in (False, True):
        llm = LLM(MODEL, enforce_eager=True, dtype="float32", target_itl_ms=0, num_kv_blocks=128,
                  disable_hybrid_kv_cache_manager=disable)
        llm.generate(PROMPTS, GREEDY)
        snapshots.append(sorted(llm.engine.kv_snapshot()["blocks"]))
    assert snapshots[0] == snapshots[1] and snapshots[0]


def _manager(window: int) -> HybridKVCacheManager:
    groups = [KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,), window)]
    return HybridKVCacheManager(BlockPool(64), BS, groups, max_step_tokens=256)


def _cached_sequence(kv: HybridKVCacheManager, tokens: list[int]) -> None:
    seq = Sequence("s", "r", 0, tokens, GREEDY, "ns", 8)
    assert kv.allocate_slots(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    kv.cache_computed_blocks(seq)
    kv.free(seq)


def test_a_sliding_hit_needs_only_the_window_before_it():
    kv = _manager(window=40)  # the token after a hit reads 39 positions back: 3 blocks
    _cached_sequence(kv, LONG)
    seq = Sequence("t", "r", 0, LONG + [7] * 30, GREEDY, "ns", 8)
    blocks, hit = kv.get_computed_blocks(seq)
    assert hit == 5 * BS  # LONG's full blocks
    assert [b is NULL_BLOCK for b in blocks[1]] == [True, True, False, False, False]
    # the sliding group lost block 3 (as eviction would): its window before block 5 is broken,
    # block 3's window is intact from the first block
    kv.pool._evict_hash(kv.pool.lookup(seq.block_hashes[3], 1))
    blocks, hit = kv.get_computed_blocks(seq)
    assert hit == 3 * BS and all(b is not NULL_BLOCK for b in blocks[1])
    assert kv.allocate_slots(seq, 10, blocks) and seq.num_computed_tokens == 3 * BS
    kv.free(seq)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_one_group_models_keep_the_plain_manager():
    llm = LLM("tiny-random-qwen3", enforce_eager=True, num_kv_blocks=16)
    assert type(llm.engine.kv) is KVCacheManager and len(llm.engine.runner.kv_cache_groups) == 1
