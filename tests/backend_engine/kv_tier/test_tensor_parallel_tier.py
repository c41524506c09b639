"""The KV tier under tensor parallelism (two gloo processes, tiny random model): each rank keeps
its own shard of every block; a prefix evicted from the pool comes back from RAM, then from
disk, with the greedy tokens of a two-rank recompute; a corrupt file on one rank's disk makes
that block recomputed on every rank, not served."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import psutil
import pytest
import torch

from backend_engine.config import EngineConfig
from backend_engine.engine import LLMEngine
from tests.backend_engine.helpers import assert_no_leaks
from tests.backend_engine.kv_tier.tier_engines import PREFIX, TURN, prefix_hashes, run

RAM_BLOCKS = 12
BLOCK_BYTES = 2 * 2 * 16 * 1 * 16 * 4  # per rank: 2 layers, K and V, 16 slots, 1 of 2 KV heads


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_rank():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


_pushes = itertools.count()


def _push(engine: LLMEngine) -> None:
    """One request of six blocks of its own through the pool."""
    i = next(_pushes)
    run(engine, f"push-{i}", [9000 + 97 * i + j for j in range(96)])


def _flood_out(engine: LLMEngine, hashes: list[int]) -> None:
    """Push requests through until none of `hashes` is left in the pool."""
    for _ in range(12):
        if not any(h in engine.pool.cached for h in hashes):
            return
        _push(engine)
    raise AssertionError("the prefix stayed in the pool")


def _rank_files(folder: Path, rank: int, hashes: list[int], timeout_s: float = 20) -> list[Path]:
    """Rank `rank`'s files of these blocks, once its writer has written them all."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = {int(p.stem, 16): p for p in (folder / f"tp2-rank{rank}").rglob("*.kvb")}
        if all(h in files for h in hashes) or time.monotonic() > deadline:
            return [files[h] for h in hashes]
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_two_ranks_restore_their_shards_from_ram_and_disk(tmp_path):
    engine = LLMEngine(EngineConfig(
        enforce_eager=True, model="tiny-random", num_kv_blocks=24, max_num_batched_tokens=128,
        target_itl_ms=0, tensor_parallel_size=2, num_threads=1, dtype="float32",
        eviction_policy="lru",  # restored blocks served a hit, which SLRU would protect
        kv_offload_size_gb=RAM_BLOCKS * BLOCK_BYTES / 2**30, kv_offload_dir=str(tmp_path)))
    workers = engine.runner.workers
    try:
        tier = engine.pool.tier
        assert tier.ram_capacity == RAM_BLOCKS
        expected, cached = run(engine, "recompute", TURN, salt="elsewhere")  # no cache to hit
        assert cached == 0
        prefix = prefix_hashes(engine)
        run(engine, "first", PREFIX + [1])
        _flood_out(engine, prefix)
        assert all(h in tier.ram for h in prefix)
        assert run(engine, "from-ram", TURN) == (expected, 96)
        assert tier.info()["hit_tokens_by_level"] == {"ram": 96, "disk": 0}

        _flood_out(engine, prefix)
        for _ in range(3):  # RAM_BLOCKS more evictions: the prefix is on disk only
            _push(engine)
        assert not any(h in tier.ram for h in prefix) and all(h in tier.disk for h in prefix)
        assert run(engine, "from-disk", TURN) == (expected, 96)
        assert tier.info()["hit_tokens_by_level"]["disk"] == 96

        _flood_out(engine, prefix)
        assert not any(h in tier.ram for h in prefix)
        flipped = _rank_files(tmp_path, 1, prefix)[2]  # rank 1's shard of block 2
        data = bytearray(flipped.read_bytes())
        data[-5] ^= 0xFF
        flipped.write_bytes(bytes(data))
        assert run(engine, "corrupt", TURN) == (expected, 32)  # blocks 0-1; 2-5 recomputed
        assert tier.info()["hit_tokens_by_level"]["disk"] == 96 + 32
        assert not flipped.exists()  # rank 1 dropped it
        assert_no_leaks(engine)
    finally:
        engine.close()
    assert all(w.exitcode == 0 for w in workers)
    assert not any(psutil.pid_exists(w.pid) for w in workers)
