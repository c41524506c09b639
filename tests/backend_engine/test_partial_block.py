"""Prefix reuse below block granularity (backend_engine/partial_block.py): the cached tokens a
prompt shares with the block continuing its cached prefix are copied, not recomputed, and the
answers stay those of a run without any cache."""

import pytest

from backend_engine.llm import LLM
from backend_engine.partial_block import BlockChildren
from backend_engine.sampling_params import SamplingParams
from tests.backend_engine.helpers import assert_no_leaks

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BASE = [(7 * i + 3) % 500 + 10 for i in range(45)]  # 2 whole blocks of 16, then 13 tokens


def test_children_find_the_longest_leading_run_most_recent_first():
    children = BlockChildren()
    children.add(1, 10, (5, 6, 7, 8))
    children.add(1, 11, (5, 6, 9, 9))
    children.add(2, 12, (5, 6, 7, 8))
    assert children.longest(1, [5, 6, 7, 0]) == (10, 3)
    assert children.longest(1, [5, 6, 9]) == (11, 3)
    assert children.longest(1, [4]) is None
    assert children.longest(3, [5, 6]) is None  # another parent (prefix, tenant) shares nothing
    children.add(1, 13, (5, 6, 0, 0))
    assert children.longest(1, [5, 6]) == (13, 2)  # a tie goes to the most recent
    children.remove(10)
    children.remove(10)  # twice is harmless
    assert children.longest(1, [5, 6, 7, 0]) == (13, 2)
    children.remove(11), children.remove(13)
    assert len(children) == 1 and children.longest(1, [5]) is None
    children.clear()
    assert len(children) == 0 and children.longest(2, [5]) is None


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", enforce_eager=True, num_kv_blocks=64, block_size=16)


def _run(llm, prompt, **kwargs):
    out = llm.generate([prompt], PARAMS, **kwargs)[0]
    assert_no_leaks(llm.engine)
    return out


@pytest.mark.parametrize("shared", [33, 40, 44])
def test_a_prompt_sharing_part_of_a_cached_block_reuses_those_tokens(llm, shared):
    llm.engine.pool.reset_prefix_cache()
    first = BASE + [900, 901, 902]
    second = BASE[:shared] + [950, 951, 952, 953, 954]
    _run(llm, first)
    out = _run(llm, second)
    assert out.num_cached_tokens == shared  # 32 by whole blocks, the rest from the third block
    llm.engine.pool.reset_prefix_cache()
    assert _run(llm, second).outputs[0].token_ids == out.outputs[0].token_ids
    fresh = LLM("tiny-random", enforce_eager=True, num_kv_blocks=64, enable_prefix_caching=False)
    assert fresh.generate([second], PARAMS)[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_the_last_prompt_token_is_always_computed(llm):
    llm.engine.pool.reset_prefix_cache()
    _run(llm, BASE + [900, 901])
    out = _run(llm, BASE[:40])  # every token but none past 40 is cached
    assert out.num_cached_tokens == 39


def test_another_tenant_reuses_nothing(llm):
    llm.engine.pool.reset_prefix_cache()
    _run(llm, BASE + [900], cache_salt="tenant-a")
    assert _run(llm, BASE[:40] + [950], cache_salt="tenant-b").num_cached_tokens == 0
    assert _run(llm, BASE[:40] + [950], cache_salt="tenant-a").num_cached_tokens == 40


def test_an_evicted_source_block_is_no_candidate(llm):
    engine = llm.engine
    engine.pool.reset_prefix_cache()
    _run(llm, BASE + [900])
    assert len(engine.pool.children) >= 1
    for block in engine.pool.blocks:  # evict everything the way an allocation does
        engine.pool._evict_hash(block)
    assert len(engine.pool.children) == 0
    assert _run(llm, BASE[:40] + [950]).num_cached_tokens == 0


def test_under_memory_pressure_answers_and_blocks_are_kept():
    """A small pool: partial hits, evictions and preemption together, same tokens as no cache."""
    prompts = [BASE[:n] + [600 + n, 601 + n] for n in (20, 36, 41, 44, 30, 38)] * 2
    small = LLM("tiny-random", enforce_eager=True, num_kv_blocks=14, block_size=16,
                max_num_seqs=4)
    plain = LLM("tiny-random", enforce_eager=True, num_kv_blocks=64, enable_prefix_caching=False)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, PARAMS)]
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, PARAMS)]
    assert_no_leaks(small.engine)
    assert small.engine.stats.prefix_cache_hits > 0


def test_a_prompt_found_cached_but_its_last_token_counts_as_drained_work(llm, monkeypatch):
    """The queue's drain rate (what admission divides waiting work by) counts prompt tokens a
    step retires, cached ones included: a fully cached prompt is not a stalled queue."""
    engine = llm.engine
    engine.pool.reset_prefix_cache()
    _run(llm, BASE + [900, 901])
    observe, retired = engine.drain.observe, []

    def record(tokens, seconds, queue_waiting, *args):
        if queue_waiting:
            retired.append(tokens)
        observe(tokens, seconds, queue_waiting, *args)

    monkeypatch.setattr(engine.drain, "observe", record)
    params = SamplingParams(temperature=0.8, max_tokens=4, n=3, seed=1)
    out = llm.generate([BASE[:44]], params)[0]  # 3 forks wait while their parent finishes
    assert out.num_cached_tokens == 43 and len(out.outputs) == 3
    assert retired and max(retired) > 0  # measured while the forks waited
    assert_no_leaks(engine)
