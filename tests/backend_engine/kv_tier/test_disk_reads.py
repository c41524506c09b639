"""Disk-tier reads off the engine thread: a request whose prefix is on disk waits, holding no
pool block, while its blocks are read; other requests step meanwhile; its answer is the one a
recompute gives; aborting it while it waits frees everything."""

import threading

import pytest

from backend_engine.kv_tier.disk_store import DiskStore
from backend_engine.sampling_params import SamplingParams
from tests.backend_engine.helpers import assert_no_leaks
from tests.backend_engine.kv_tier.tier_engines import (TURN, add, disk_tier_after_a_flood, run,
                                                       tier_engine)

OTHER = [5000 + i for i in range(40)]


@pytest.fixture(scope="module")
def disk_tier(tmp_path_factory):
    """A disk tier holding PREFIX's blocks, and the greedy tokens of TURN recomputed."""
    folder = tmp_path_factory.mktemp("tier")
    disk_tier_after_a_flood(folder)
    engine = tier_engine()
    try:
        return folder, run(engine, "ref", TURN)[0]
    finally:
        engine.close()


@pytest.fixture
def slow_disk(monkeypatch):
    """Disk reads that block until the test opens the gate."""
    gate = threading.Event()
    load = DiskStore._load

    def gated(self, block_hash):
        gate.wait(30)
        return load(self, block_hash)
    monkeypatch.setattr(DiskStore, "_load", gated)
    yield gate
    gate.set()


def _seq(engine, rid):
    return engine.requests[rid].seqs[0]


def test_other_requests_step_while_a_prefix_is_read_from_disk(disk_tier, slow_disk):
    folder, expected = disk_tier
    engine = tier_engine(kv_offload_dir=str(folder))
    try:
        add(engine, "again", TURN)
        add(engine, "other", OTHER)
        done = {}
        for _ in range(50):
            done.update({o.request_id: o for o in engine.step() if o.finished})
            if "other" in done:
                break
        assert "other" in done  # it prefilled and decoded all its tokens meanwhile
        seq, staging = _seq(engine, "again"), engine.pool.tier.staging
        assert seq.block_table == [] and seq not in engine.scheduler.running
        assert staging.num_blocks == 6 and staging.pending(list(staging.by_hash))
        slow_disk.set()
        while "again" not in done:
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert done["again"].outputs[0].token_ids == expected
        assert done["again"].num_cached_tokens == 96
        info = engine.load()["kv_tier"]
        assert info["hit_tokens_by_level"]["disk"] == 96 and info["read_blocks"] == 0
        assert info["read_seconds_total"] > 0  # the reader thread waited at the gate
        assert_no_leaks(engine)
    finally:
        engine.close()


def test_aborting_a_request_that_waits_for_its_read_frees_everything(disk_tier, slow_disk):
    folder, expected = disk_tier
    engine = tier_engine(kv_offload_dir=str(folder))
    try:
        add(engine, "again", TURN)
        engine.step()
        staging = engine.pool.tier.staging
        assert staging.num_blocks == 6 and _seq(engine, "again").block_table == []
        assert engine.abort_request("again").finished
        assert staging.num_blocks == 0 and not staging.reads and not staging.by_hash
        assert_no_leaks(engine)
        slow_disk.set()
        assert run(engine, "later", TURN) == (expected, 96)  # read again, and served
        assert_no_leaks(engine)
    finally:
        engine.close()


def test_reads_in_flight_are_capped_and_the_rest_recomputed(disk_tier):
    folder, expected = disk_tier
    engine = tier_engine(kv_offload_dir=str(folder))
    try:
        engine.pool.tier.staging.max_blocks = 4
        assert run(engine, "again", TURN) == (expected, 64)
        assert engine.load()["kv_tier"]["hit_tokens_by_level"]["disk"] == 64
    finally:
        engine.close()


def test_a_wait_for_a_read_under_pool_pressure_neither_leaks_nor_deadlocks(disk_tier, slow_disk):
    """Two long requests that outgrow the 24-block pool together (one is preempted) run while a
    third waits for its prefix from disk; everything finishes and every block comes back."""
    folder, expected = disk_tier
    engine = tier_engine(kv_offload_dir=str(folder))
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    try:
        add(engine, "again", TURN)
        for i in range(2):
            engine.add_request(f"hog-{i}", [7000 + 300 * i + j for j in range(96)], long)
        done = {}
        for step in range(400):
            if step == 20:
                slow_disk.set()
            done.update({o.request_id: o for o in engine.step() if o.finished})
            if len(done) == 3:
                break
        assert set(done) == {"again", "hog-0", "hog-1"}
        assert done["again"].outputs[0].token_ids == expected
        assert engine.scheduler.num_preemptions > 0
        assert engine.pool.tier.staging.num_blocks == 0
        assert_no_leaks(engine)
    finally:
        engine.close()
