"""PrefixIndex: snapshots, events, gaps, restarts, eviction bounds, predicted entries."""

import pytest

from routing.index import BlockSizeMismatch, PrefixIndex


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_index(**kw):
    clock = FakeClock()
    index = PrefixIndex(clock=clock, **kw)
    for name in ("a", "b", "c"):
        index.add_replica(name)
    return index, clock


def test_snapshot_then_events_build_the_longest_prefix_per_replica():
    index, _ = make_index()
    index.apply_snapshot("a", {"seq": 5, "block_size": 16, "blocks": [1, 2, 3]})
    index.apply_snapshot("b", {"seq": 0, "block_size": 16, "blocks": [1]})
    assert index.apply_event("b", {"seq": 1, "stored": [2], "removed": []})
    assert index.apply_event("a", {"seq": 6, "stored": [4], "removed": [2]})
    assert index.match([1, 2, 3, 4]) == {"a": 1, "b": 2, "c": 0}


def test_match_counts_only_consecutive_blocks_from_the_start():
    index, _ = make_index()
    index.apply_snapshot("a", {"seq": 0, "blocks": [2, 3, 4]})  # block 1 missing
    assert index.match([1, 2, 3, 4])["a"] == 0


def test_sequence_gap_asks_for_resync_and_snapshot_restores():
    index, _ = make_index()
    index.apply_snapshot("a", {"seq": 1, "blocks": [1]})
    assert index.apply_event("a", {"seq": 3, "stored": [2]}) is False
    # Until the snapshot is re-read, further events are refused too.
    assert index.apply_event("a", {"seq": 4, "stored": [3]}) is False
    index.apply_snapshot("a", {"seq": 4, "blocks": [1, 2, 3]})
    assert index.apply_event("a", {"seq": 5, "stored": [4]}) is True
    assert index.match([1, 2, 3, 4])["a"] == 4
    assert index.size().resyncs == 1


def test_seq_going_backwards_drops_the_replicas_entries():
    index, _ = make_index()
    index.apply_snapshot("a", {"seq": 10, "blocks": [1, 2]})
    assert index.apply_event("a", {"seq": 1, "stored": [9]}) is False
    assert index.match([1, 2])["a"] == 0
    assert index.size().resident_entries == 0


def test_new_instance_id_drops_entries_even_with_higher_seq():
    index, _ = make_index()
    index.apply_snapshot("a", {"seq": 3, "blocks": [1, 2], "instance_id": "x"})
    assert index.apply_event("a", {"seq": 4, "stored": [3], "instance_id": "y"}) is False
    assert index.match([1, 2])["a"] == 0


def test_duplicate_event_is_ignored():
    index, _ = make_index()
    index.apply_snapshot("a", {"seq": 1, "blocks": [1]})
    assert index.apply_event("a", {"seq": 2, "stored": [2]})
    assert index.apply_event("a", {"seq": 2, "stored": [2]})
    assert index.size().resident_entries == 2


def test_cleared_event_empties_the_replica_before_storing():
    index, _ = make_index()
    index.apply_snapshot("a", {"seq": 1, "blocks": [1, 2, 3]})
    assert index.apply_event("a", {"seq": 2, "cleared": True, "stored": [7]})
    assert index.match([1])["a"] == 0 and index.match([7])["a"] == 1


def test_block_size_mismatch_is_refused():
    index, _ = make_index()
    with pytest.raises(BlockSizeMismatch):
        index.apply_snapshot("a", {"seq": 0, "block_size": 32, "blocks": []})


def test_drop_replica_keeps_other_replicas_entries():
    index, _ = make_index()
    index.apply_snapshot("a", {"seq": 0, "blocks": [1, 2]})
    index.apply_snapshot("b", {"seq": 0, "blocks": [1, 2]})
    index.drop_replica("a")
    assert index.match([1, 2]) == {"a": 0, "b": 2, "c": 0}


def test_max_entries_bounds_memory_by_evicting_oldest_of_largest_replica():
    index, _ = make_index(max_entries=100)
    index.apply_snapshot("a", {"seq": 0, "blocks": list(range(90))})
    index.apply_snapshot("b", {"seq": 0, "blocks": list(range(1000, 1050))})
    size = index.size()
    assert size.resident_entries <= 100
    assert size.evictions >= 40
    assert index.match([89])["a"] == 1  # the newest of the large replica survive
    assert index.match([1000])["b"] == 1  # the small replica was not robbed


def test_max_bytes_turns_into_an_entry_cap():
    index, _ = make_index(max_bytes=200 * 50)
    index.apply_snapshot("a", {"seq": 0, "blocks": list(range(500))})
    size = index.size()
    assert size.resident_entries <= 50 and size.estimated_bytes <= 200 * 50


def test_predicted_entries_expire_after_ttl():
    index, clock = make_index(predicted_ttl_s=2.0)
    index.record_route("b", [1, 2, 3])
    assert index.match([1, 2, 3])["b"] == 3
    clock.now += 1.9
    assert index.match([1, 2, 3])["b"] == 3
    clock.now += 0.2
    assert index.match([1, 2, 3])["b"] == 0
    assert index.size().predicted_entries == 0


def test_repredicting_extends_the_ttl():
    index, clock = make_index(predicted_ttl_s=2.0)
    index.record_route("b", [1])
    clock.now += 1.5
    index.record_route("b", [1])
    clock.now += 1.0
    assert index.match([1])["b"] == 1


def test_predicted_entries_are_bounded():
    index, _ = make_index(max_predicted_entries=10)
    index.record_route("a", list(range(25)))
    assert index.size().predicted_entries <= 10


def test_approximate_replica_learns_from_routing_as_lru_of_its_capacity():
    index = PrefixIndex(predicted_ttl_s=0)
    index.add_replica("llamacpp", approximate=True, capacity_blocks=4)
    index.record_route("llamacpp", [1, 2, 3])
    assert index.match([1, 2, 3])["llamacpp"] == 3
    index.record_route("llamacpp", [1, 8, 9])  # touches 1, then 2 and 3 are the oldest
    assert index.size().resident_entries == 4
    assert index.match([1, 8, 9])["llamacpp"] == 3
    assert index.match([1, 2, 3])["llamacpp"] == 1


def test_removed_replica_slot_is_reused_cleanly():
    index, _ = make_index()
    index.apply_snapshot("a", {"seq": 0, "blocks": [1]})
    index.record_route("a", [5])
    index.remove_replica("a")
    index.add_replica("d")
    assert index.match([1]) == {"b": 0, "c": 0, "d": 0}
    assert index.match([5])["d"] == 0
