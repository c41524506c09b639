import pytest

from backend_engine.block_pool import BlockPool, NoFreeBlocksError


def test_freed_cached_blocks_stay_hits_until_reused():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, 111)
    pool.release([b, a])
    assert pool.lookup(111) is a
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 3


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, 1)
    pool.release([c, b, a])
    first, second = pool.allocate(2)
    assert {first.block_id, second.block_id} == {b.block_id, c.block_id}
    assert pool.lookup(1) is a


def test_lru_evicts_the_least_recently_freed_cached_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.release([a])
    pool.release([b])
    (x,) = pool.allocate(1)
    assert x is a and pool.lookup(1) is None and pool.lookup(2) is b


def test_events_are_numbered_and_report_final_state():
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 7)
    e1 = pool.flush_events()
    assert (e1.seq, e1.stored, e1.removed) == (1, [7], [])
    pool.release([a])
    (a2,) = pool.allocate(1)  # evicts 7
    pool.cache_block(a2, 8)
    e2 = pool.flush_events()
    assert (e2.seq, e2.stored, e2.removed) == (2, [8], [7])
    assert pool.flush_events() is None
    assert [e.seq for e in pool.events_since(0)] == [1, 2]
    assert pool.events_since(2) == []


def test_events_since_reports_a_gap_past_the_replay_buffer():
    pool = BlockPool(8, event_buffer=2)
    for h in range(5):
        (blk,) = pool.allocate(1)
        pool.cache_block(blk, 100 + h)
        pool.flush_events()
    assert pool.events_since(0) is None
    assert [e.seq for e in pool.events_since(3)] == [4, 5]


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_caching_disabled_never_registers_hashes():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 5)
    assert pool.lookup(5) is None and pool.flush_events() is None
