"""Block pool: pinned blocks and the scan-resistant (segmented LRU) eviction order against plain
LRU."""

import logging

import pytest

from backend_engine.block_pool import BlockNotCachedError, BlockPool, PinnedCapacityError
from backend_engine.config import EngineConfig
from backend_engine.free_queue import FreeBlockQueue


def _store(pool: BlockPool, hashes: list[int]):
    """Compute blocks for these hashes as one request would, then free them (tail first)."""
    blocks = pool.allocate(len(hashes))
    for block, h in zip(blocks, hashes):
        pool.cache_block(block, h)
    pool.release(list(reversed(blocks)))
    return blocks


def _hit(pool: BlockPool, hashes: list[int]) -> None:
    blocks = [pool.lookup(h) for h in hashes]
    pool.touch(blocks)
    pool.release(list(reversed(blocks)))


def _flood(pool: BlockPool, start: int, n: int) -> None:
    for i in range(n):
        _store(pool, [start + i])


def test_pinned_blocks_survive_a_flood_of_one_off_prompts():
    pool = BlockPool(16, max_pinned_fraction=0.25)
    _store(pool, [1, 2, 3])
    pool.pin([1, 2, 3])
    _flood(pool, 1000, 200)
    assert all(pool.lookup(h) is not None for h in (1, 2, 3))
    assert pool.num_pinned_blocks == 3 and pool.num_free_blocks == 13


def test_pinned_capacity_is_bounded_and_a_refused_pin_changes_nothing():
    pool = BlockPool(16, max_pinned_fraction=0.25)  # 4 pinnable blocks
    _store(pool, [1, 2, 3, 4, 5])
    pool.pin([1, 2, 3])
    with pytest.raises(PinnedCapacityError):
        pool.pin([4, 5])
    assert pool.num_pinned_blocks == 3 and pool.num_free_blocks == 13
    assert pool.lookup(4).pin_cnt == 0 and pool.lookup(4).ref_cnt == 0
    pool.pin([1, 2, 3, 4])  # overlapping pins count shared blocks once
    assert pool.num_pinned_blocks == 4


def test_pin_of_an_uncached_hash_is_refused_whole():
    pool = BlockPool(8)
    _store(pool, [1])
    with pytest.raises(BlockNotCachedError):
        pool.pin([1, 99])
    assert pool.num_pinned_blocks == 0 and pool.lookup(1).ref_cnt == 0


def test_unpin_releases_blocks_to_the_cache_without_leaks():
    pool = BlockPool(8)
    _store(pool, [1, 2])
    first = pool.pin([1, 2])
    second = pool.pin([1])
    pool.unpin(first)
    assert pool.lookup(1).pin_cnt == 1 and pool.num_pinned_blocks == 1
    pool.unpin(second)
    assert pool.num_pinned_blocks == 0 and pool.num_free_blocks == 8
    assert all(b.ref_cnt == 0 and b.pin_cnt == 0 for b in pool.blocks)
    assert pool.lookup(1) is not None and pool.lookup(2) is not None  # still hits


def test_a_pinned_block_freed_by_its_request_stays_cached():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 7)
    pool.pin([7])
    pool.release([a])
    _flood(pool, 100, 20)
    assert pool.lookup(7) is a and a.ref_cnt == 1


def test_pins_emit_no_kv_events_and_eviction_events_stay_exact():
    pool = BlockPool(4, max_pinned_fraction=0.5)
    _store(pool, [1, 2])
    assert pool.flush_events().stored == [1, 2]
    pool.pin([1])
    assert pool.flush_events() is None
    _flood(pool, 100, 3)
    event = pool.flush_events()
    assert 1 not in event.removed and 2 in event.removed
    assert set(pool.cached) == {1} | set(event.stored) - set(event.removed)


def test_slru_keeps_reused_blocks_through_a_flood_lru_does_not():
    survivors = {}
    for policy in ("lru", "slru"):
        pool = BlockPool(8, eviction_policy=policy)
        _store(pool, [1, 2])
        _hit(pool, [1, 2])
        _flood(pool, 100, 20)
        survivors[policy] = [h for h in (1, 2) if pool.lookup(h) is not None]
    assert survivors == {"lru": [], "slru": [1, 2]}


def test_slru_evicts_blocks_without_a_hash_then_one_offs_then_reused():
    pool = BlockPool(4, eviction_policy="slru")
    a, b, c, d = pool.allocate(4)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.release([a, b, c])
    _hit(pool, [1])
    assert pool.free.eviction_order() == [c.block_id, b.block_id, a.block_id]


def test_protected_segment_is_bounded_and_demotes_its_least_recent_block():
    blocks = BlockPool(4).blocks
    queue = FreeBlockQueue(blocks, "slru", protected_cap=1)
    for block_id, h in ((0, 10), (1, 11)):
        blocks[block_id].block_hash, blocks[block_id].hits = h, 1
        queue.empty.pop(block_id)
        queue.push(blocks[block_id])
    assert list(queue.protected) == [1] and list(queue.probation) == [0]
    assert blocks[0].hits == 0


def test_unknown_eviction_policy_is_refused():
    with pytest.raises(ValueError, match="eviction_policy"):
        BlockPool(4, eviction_policy="fifo")
    with pytest.raises(ValueError, match="eviction_policy"):
        EngineConfig(eviction_policy="fifo").validate()


def test_old_eviction_policy_name_means_slru_with_one_warning(caplog):
    config = EngineConfig(eviction_policy="kvgate")
    with caplog.at_level(logging.WARNING, logger="backend_engine.free_queue"):
        config.validate()
        pool = BlockPool(4, eviction_policy=config.eviction_policy)
    assert config.eviction_policy == "slru" and pool.free.policy == "slru"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'kvgate' is deprecated" in warnings[0]
    assert BlockPool(4, eviction_policy="kvgate").free.policy == "slru"
