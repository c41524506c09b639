"""The KV tier under a bare block pool (small K/V tensors, no model): what eviction copies in,
its byte bounds and LRU, its events in kvgate's and vLLM's forms, and its disk files."""

import torch

from backend_engine.block_pool import BlockOrigin, BlockPool
from backend_engine.kv_tier.tier import KVTier
from backend_engine.kv_transfer.block_io import BlockIO
from backend_engine.server.kv_zmq_events import to_batch
from protocol.kv_events import BlockRemoved, BlockStored
from routing.hashing import block_hashes

LAYERS, HEADS, DIM, BS = 2, 2, 4, 16


def _pool(num_blocks: int, ram_blocks: int, **disk) -> tuple[BlockPool, KVTier]:
    kv = [(torch.zeros(num_blocks, BS, HEADS, DIM), torch.zeros(num_blocks, BS, HEADS, DIM))
          for _ in range(LAYERS)]
    io = BlockIO(kv, "m")
    pool = BlockPool(num_blocks)
    pool.tier = KVTier(io, ram_blocks * io.layout.block_bytes, **disk)
    return pool, pool.tier


def _fill(pool: BlockPool, tokens: list[int], value: float) -> list[int]:
    """Cache the blocks of `tokens`, their K/V all `value` + block index."""
    hashes = block_hashes(tokens, "m", BS)
    blocks = pool.allocate(len(hashes))
    for i, (block, h) in enumerate(zip(blocks, hashes)):
        for key, val in pool.tier.io.kv_caches:
            key[block.block_id] = value + i
            val[block.block_id] = -(value + i)
        pool.cache_block(block, h, BlockOrigin(hashes[i - 1] if i else None,
                                               tuple(tokens[i * BS:(i + 1) * BS]), "m"))
    pool.release(list(reversed(blocks)))
    return hashes


def test_eviction_copies_blocks_in_and_restore_writes_them_back():
    pool, tier = _pool(4, ram_blocks=8)
    first = _fill(pool, list(range(64)), 10.0)
    _fill(pool, list(range(1000, 1064)), 50.0)  # evicts all four blocks of `first`
    assert all(h in tier for h in first) and not any(h in pool.cached for h in first)
    fresh = pool.allocate(2)
    assert tier.restore(first[:2], [b.block_id for b in fresh]) == 2
    key = tier.io.kv_caches[1][0]
    assert key[fresh[0].block_id].eq(10.0).all() and key[fresh[1].block_id].eq(11.0).all()


def test_the_ram_level_is_bounded_in_bytes_with_its_own_lru():
    pool, tier = _pool(4, ram_blocks=3)
    first = _fill(pool, list(range(64)), 1.0)
    pool.flush_events()
    second = _fill(pool, list(range(1000, 1064)), 2.0)
    # a request's blocks are freed tail first, so its tail is evicted (and dropped) first
    assert len(tier.ram) == 3 and first[3] not in tier and set(tier.ram) == set(first[:3])
    event = pool.flush_events()
    assert set(event.tier_stored) == set(first[:3]) and event.tier_removed == []
    assert event.to_dict()["tier_stored"] == event.tier_stored
    _fill(pool, list(range(2000, 2064)), 3.0)
    event = pool.flush_events()
    assert set(event.tier_stored) == set(second[:3]) and set(event.tier_removed) == set(first[:3])


def test_tier_blocks_are_published_under_the_tier_medium():
    pool, tier = _pool(4, ram_blocks=8)
    pool.keep_origins = True
    first = _fill(pool, list(range(64)), 1.0)
    pool.flush_events()
    _fill(pool, list(range(1000, 1064)), 2.0)
    batch = to_batch(pool.flush_events(), "m", BS, "CPU", "CPU_TIER")
    tier_stored = [e for e in batch.events if isinstance(e, BlockStored) and e.medium == "CPU_TIER"]
    assert [e.block_hashes for e in tier_stored] == [first]
    assert tier_stored[0].token_ids == list(range(64)) and tier_stored[0].parent_block_hash is None
    assert BlockRemoved(first[::-1], "CPU") in batch.events  # out of the pool, tail first
    tier.clear()
    batch = to_batch(pool.flush_events(), "m", BS, "CPU", "CPU_TIER")
    removed = [e for e in batch.events if isinstance(e, BlockRemoved) and e.medium == "CPU_TIER"]
    assert [set(e.block_hashes) for e in removed] == [set(first)]


def test_a_disk_tier_is_written_off_thread_and_read_back_after_a_restart(tmp_path):
    pool, tier = _pool(4, ram_blocks=0, disk_dir=str(tmp_path), disk_bytes=1 << 20)
    first = _fill(pool, list(range(64)), 7.0)
    _fill(pool, list(range(1000, 1064)), 8.0)
    tier.disk.flush()
    assert tier.disk.backlog == 0 and len(list(tmp_path.rglob("*.kvb"))) == 4
    tier.close()
    pool, tier = _pool(4, ram_blocks=0, disk_dir=str(tmp_path), disk_bytes=1 << 20)
    assert set(tier.hashes()) == set(first)
    fresh = pool.allocate(4)
    assert tier.restore(first, [b.block_id for b in fresh]) == 0  # disk blocks: read first
    assert tier.wait_for_disk("r", first)  # the reader thread reads them
    tier.staging.reads["r"].done.wait(5)
    assert not tier.wait_for_disk("r", first)
    assert tier.restore(first, [b.block_id for b in fresh]) == 4
    assert tier.io.kv_caches[0][1][fresh[3].block_id].eq(-10.0).all()
    assert tier.info()["hit_tokens_by_level"] == {"ram": 0, "disk": 64}
    tier.close()


def test_the_disk_level_is_bounded_and_drops_its_oldest_files(tmp_path):
    pool, tier = _pool(4, ram_blocks=0, disk_dir=str(tmp_path), disk_bytes=0)
    assert tier.disk.capacity_blocks == 0
    _fill(pool, list(range(64)), 1.0)
    _fill(pool, list(range(1000, 1064)), 2.0)
    assert tier.hashes() == [] and tier.disk.dropped_writes == 4
    file_bytes = tier.disk.file_bytes  # a header and 2 layers x K/V x 16 x 2 x 4 floats
    assert file_bytes - 2 * 2 * 16 * 2 * 4 * 4 < 64
    tier.close()
    pool, tier = _pool(4, ram_blocks=0, disk_dir=str(tmp_path), disk_bytes=2 * file_bytes)
    first = _fill(pool, list(range(64)), 1.0)  # evicted tail first: blocks 1 and 0 stay
    _fill(pool, list(range(1000, 1064)), 2.0)
    tier.disk.flush()
    assert set(tier.hashes()) == set(first[:2]) and len(list(tmp_path.rglob("*.kvb"))) == 2
    tier.close()


def test_a_gateway_following_vllm_events_keeps_tier_blocks_apart():
    from routing.engine_blocks import EngineBlockMap

    pool, tier = _pool(4, ram_blocks=8)
    pool.keep_origins = True
    mapper = EngineBlockMap("m", BS)
    first = _fill(pool, list(range(64)), 1.0)
    changes = mapper.apply(to_batch(pool.flush_events(), "m", BS, "CPU", "CPU_TIER"))
    assert (changes.stored, changes.tier_stored) == (first, [])
    pool.allocate(2)  # evicts blocks 3 then 2; their parent, block 1, stays in the pool
    changes = mapper.apply(to_batch(pool.flush_events(), "m", BS, "CPU", "CPU_TIER"))
    assert set(changes.removed) == set(first[2:]) and set(changes.tier_stored) == set(first[2:])
    assert mapper.canonical == set(first[:2]) and mapper.tier_canonical == set(first[2:])
    tier.clear()
    changes = mapper.apply(to_batch(pool.flush_events(), "m", BS, "CPU", "CPU_TIER"))
    assert set(changes.tier_removed) == set(first[2:]) and not mapper.tier_canonical
