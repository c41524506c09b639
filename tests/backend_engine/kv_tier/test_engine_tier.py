"""The KV tier through the engine (tiny random model, a 24-block pool): an evicted prefix comes
back from the tier with the tokens a recompute gives, counted as cached; tenants stay apart;
a disk tier survives a restart; corrupt files are refused."""

from pathlib import Path

import pytest

from backend_engine.config import EngineConfig
from backend_engine.engine import LLMEngine
from backend_engine.sampling_params import SamplingParams
from routing.hashing import block_hashes, namespace_for
from tests.backend_engine.helpers import assert_no_leaks
from tests.backend_engine.kv_tier.tier_engines import (PREFIX, disk_tier_after_a_flood, flood,
                                                       prefix_hashes, run, tier_engine)


@pytest.fixture(scope="module")
def recompute():
    """The greedy tokens of PREFIX + a turn, with no cache at all."""
    engine = LLMEngine(EngineConfig(enforce_eager=True, model="tiny-random", num_kv_blocks=24,
                                    max_num_batched_tokens=128, target_itl_ms=0,
                                    enable_prefix_caching=False))
    try:
        return run(engine, "ref", PREFIX + [5, 6, 7])[0]
    finally:
        engine.close()


def test_an_evicted_prefix_is_restored_from_ram_with_recomputed_tokens(recompute):
    engine = tier_engine(kv_offload_size_gb=0.01)
    try:
        run(engine, "first", PREFIX + [1])
        flood(engine)
        assert engine.pool.lookup(prefix_hashes(engine)[0]) is None  # gone from the pool
        tokens, cached = run(engine, "again", PREFIX + [5, 6, 7])
        assert tokens == recompute
        assert cached == 96
        info = engine.load()["kv_tier"]
        assert info["hit_tokens"] == 96 and info["hit_tokens_by_level"]["ram"] == 96
        assert_no_leaks(engine)
    finally:
        engine.close()


def test_without_a_tier_the_same_flood_loses_the_prefix():
    engine = tier_engine()
    try:
        run(engine, "first", PREFIX + [1])
        flood(engine)
        assert run(engine, "again", PREFIX + [5, 6, 7])[1] == 0
        assert "kv_tier" not in engine.load()
    finally:
        engine.close()


def test_a_tier_never_serves_another_tenants_blocks():
    engine = tier_engine(kv_offload_size_gb=0.01)
    try:
        run(engine, "a", PREFIX + [1], salt="tenant-a")
        flood(engine)
        assert run(engine, "b", PREFIX + [5, 6, 7], salt="tenant-b")[1] == 0
        assert run(engine, "a2", PREFIX + [5, 6, 7], salt="tenant-a")[1] == 96
    finally:
        engine.close()


def test_a_disk_tier_survives_a_restart(tmp_path, recompute):
    disk_tier_after_a_flood(tmp_path)
    engine = tier_engine(kv_offload_dir=str(tmp_path))
    try:
        assert len(engine.pool.tier_hashes()) > 6
        tokens, cached = run(engine, "again", PREFIX + [5, 6, 7])
        assert (tokens, cached) == (recompute, 96)
        assert engine.load()["kv_tier"]["hit_tokens_by_level"]["disk"] == 96
    finally:
        engine.close()


def test_corrupt_and_truncated_tier_files_are_dropped_and_counted(tmp_path, recompute):
    hashes = disk_tier_after_a_flood(tmp_path)
    files = {int(p.stem, 16): p for p in Path(tmp_path).rglob("*.kvb")}
    prefix = block_hashes(PREFIX, namespace_for("tiny-random", None), 16)
    assert set(prefix) <= set(hashes)
    truncated, flipped = files[prefix[4]], files[prefix[2]]
    truncated.write_bytes(truncated.read_bytes()[:-100])
    data = bytearray(flipped.read_bytes())
    data[-7] ^= 0xFF
    flipped.write_bytes(bytes(data))
    engine = tier_engine(kv_offload_dir=str(tmp_path))
    try:
        assert engine.load()["kv_tier"]["corrupt_files"] == 1  # the truncated one, at start
        tokens, cached = run(engine, "again", PREFIX + [5, 6, 7])
        assert tokens == recompute
        assert cached == 32  # blocks 0-1; block 2 failed its checksum and was recomputed
        info = engine.load()["kv_tier"]
        assert info["corrupt_files"] == 2
        assert not flipped.exists() and not truncated.exists()
    finally:
        engine.close()


def test_a_restore_composes_with_chunked_prefill(recompute):
    engine = LLMEngine(EngineConfig(enforce_eager=True, model="tiny-random", num_kv_blocks=24,
                                    max_num_batched_tokens=32, target_itl_ms=0,
                                    kv_offload_size_gb=0.01))
    try:
        run(engine, "first", PREFIX + [1])  # prefilled in 32-token chunks
        flood(engine)
        assert run(engine, "again", PREFIX + [5, 6, 7]) == (recompute, 96)
    finally:
        engine.close()


def test_preempted_requests_come_back_through_the_tier():
    """Two requests that outgrow a 24-block pool together: the newer is preempted, its prompt
    blocks are evicted into the tier and restored when it is scheduled again."""
    prompts = {"a": PREFIX + [1], "b": [700 + i for i in range(96)] + [2]}
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)

    def serve(engine: LLMEngine) -> dict[str, list[int]]:
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, params)
        done = {}
        while len(done) < len(prompts):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return done

    alone = LLMEngine(EngineConfig(enforce_eager=True, model="tiny-random", num_kv_blocks=64,
                                   max_num_batched_tokens=128, target_itl_ms=0,
                                   enable_prefix_caching=False))
    try:
        expected = serve(alone)
    finally:
        alone.close()
    engine = tier_engine(kv_offload_size_gb=0.01)
    try:
        assert serve(engine) == expected
        assert engine.scheduler.num_preemptions > 0
        assert engine.load()["kv_tier"]["hit_tokens"] > 0
        assert_no_leaks(engine)
    finally:
        engine.close()
