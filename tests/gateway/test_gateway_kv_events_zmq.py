"""A real gateway following a vLLM-style ZMQ KV event publisher (`--kv-events`): stored, removed
and cleared blocks reach its index under canonical hashes; gaps are filled by replay; restarts
and vanished publishers drop the entries (approximate until events flow again); unknown parents
are dropped; two DP ranks feed one replica; bad messages are counted and skipped."""

from __future__ import annotations

import time

import httpx
import pytest

from benchmarks.gateway_overhead import FIXTURE_MODEL
from protocol.kv_events import AllBlocksCleared, BlockRemoved, KVEventBatch
from tests.gateway import procs
from tests.gateway.zmq_publishers import free_ports, publisher, stored_batch

pytestmark = pytest.mark.timeout(180)

BS = 16


@pytest.fixture(scope="module")
def cluster():
    upstream = procs.fixture_upstream()
    upstream.start()
    # Starts following an ipc endpoint nobody publishes on: approximate until each test adds
    # the replica again with its own publisher.
    gw = procs.gateway([upstream.url], "--kv-events", "ipc:///tmp/kvgate-test-nobody",
                       "--tokenizer", f"{FIXTURE_MODEL}={procs.tokenizer_folder()}").start()
    try:
        yield upstream, gw
    finally:
        gw.stop()
        upstream.stop()


def row(gw) -> dict:
    return procs.admin(gw, "/replicas").json()["data"][0]


def follow(cluster, spec: str) -> str:
    """Re-add the upstream as a replica following `spec`; its name."""
    upstream, gw = cluster
    for r in procs.admin(gw, "/replicas").json()["data"]:
        procs.admin(gw, f"/replicas/{r['name']}", "DELETE")
    added = procs.admin(gw, "/replicas", "POST", json={"url": upstream.url, "kv_events": spec})
    assert added.status_code == 200, added.text
    return added.json()["name"]


def predicted(gw, tokens: list[int]) -> int:
    r = httpx.post(gw.url + "/v1/completions", timeout=10,
                   json={"model": FIXTURE_MODEL, "prompt": tokens, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return procs.admin(gw, "/decisions?limit=1").json()["data"][0]["predicted_cached_tokens"]


def until(gw, check, timeout_s: float = 10.0) -> dict:
    assert procs.wait_until(lambda: check(row(gw)), timeout_s), row(gw)
    return row(gw)


def prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 1009 + i * 7) % 30_000 + 1 for i in range(blocks * BS)]


def test_stored_removed_and_cleared_blocks_reach_the_index(cluster):
    _, gw = cluster
    port, replay = free_ports(2)
    pub, _ = publisher(port, replay)
    try:
        follow(cluster, f"tcp://127.0.0.1:{port},replay=tcp://127.0.0.1:{replay}")
        until(gw, lambda r: r["index_mode"] == "exact (zmq)")
        tokens = prompt(1, 6)
        batch, hashes = stored_batch(tokens)
        pub.publish(batch)
        r = until(gw, lambda r: r["index_blocks"] == 6)
        assert r["event_lag_s"] is not None and r["kv_events"]["blocks"]["stored_blocks"] == 6
        # The gateway names the engine's blocks with its own hashes: the prompt is predicted cached.
        assert predicted(gw, tokens + [5, 6, 7]) == 6 * BS
        pub.publish(KVEventBatch(time.time(), [BlockRemoved(hashes[4:], "GPU")]))
        until(gw, lambda r: r["index_blocks"] == 4)
        pub.publish(KVEventBatch(time.time(), [AllBlocksCleared()]))
        until(gw, lambda r: r["index_blocks"] == 0)
    finally:
        pub.shutdown()


def test_a_late_gateway_replays_history_and_a_gap_is_filled(cluster):
    _, gw = cluster
    port, replay = free_ports(2)
    pub, faulty = publisher(port, replay)
    try:
        tokens = prompt(2, 8)
        batch, hashes = stored_batch(tokens[:4 * BS])
        pub.publish(batch)  # before the gateway follows: only the replay can tell it
        time.sleep(0.2)
        follow(cluster, f"tcp://127.0.0.1:{port},replay=tcp://127.0.0.1:{replay}")
        until(gw, lambda r: r["index_blocks"] == 4)
        faulty.drop = 1  # the next batch never reaches the live stream
        pub.publish(stored_batch(tokens, first=4)[0])  # blocks 4-5 .. 7, children of block 3
        pub.publish(KVEventBatch(time.time(), [BlockRemoved([hashes[3]], "GPU")]))
        r = until(gw, lambda r: r["kv_events"]["batches"] >= 3 and r["index_blocks"] == 7)
        assert r["kv_events"]["replays"] >= 2 and r["kv_events"]["replays_lost"] == 0
    finally:
        pub.shutdown()


def test_unknown_parents_are_dropped_and_without_replay_nothing_is_guessed(cluster):
    _, gw = cluster
    (port,) = free_ports(1)
    pub, faulty = publisher(port, None)
    try:
        follow(cluster, f"tcp://127.0.0.1:{port}")
        until(gw, lambda r: r["index_mode"] == "exact (zmq)")
        time.sleep(0.3)  # the subscription reaches the publisher
        tokens = prompt(3, 6)
        pub.publish(stored_batch(tokens[:2 * BS])[0])
        until(gw, lambda r: r["index_blocks"] == 2)
        faulty.drop = 1
        pub.publish(stored_batch(tokens[:4 * BS], first=2)[0])  # lost, and no replay endpoint
        pub.publish(stored_batch(tokens, first=4)[0])  # children of the lost blocks
        r = until(gw, lambda r: r["kv_events"]["blocks"]["unknown_parent"] == 2)
        # What it had may be stale now (a lost batch can remove blocks): dropped, not guessed.
        assert r["index_blocks"] == 0 and r["kv_events"]["replays_lost"] == 1
    finally:
        pub.shutdown()


def test_publisher_restart_and_disappearance_drop_its_blocks(cluster):
    _, gw = cluster
    port, replay = free_ports(2)
    pub, _ = publisher(port, replay)
    follow(cluster, f"tcp://127.0.0.1:{port},replay=tcp://127.0.0.1:{replay}")
    until(gw, lambda r: r["index_mode"] == "exact (zmq)")
    pub.publish(stored_batch(prompt(4, 5))[0])
    until(gw, lambda r: r["index_blocks"] == 5)
    pub.shutdown()  # the engine goes away: its blocks with it, approximate routing meanwhile
    until(gw, lambda r: r["index_mode"] == "approximate" and r["index_blocks"] == 0)
    pub, _ = publisher(port, replay)  # a new engine process on the same ports, seq from 0
    try:
        pub.publish(stored_batch(prompt(5, 3))[0])
        r = until(gw, lambda r: r["index_mode"] == "exact (zmq)" and r["index_blocks"] == 3)
        assert r["kv_events"]["disconnects"] >= 1
    finally:
        pub.shutdown()


def test_two_dp_ranks_feed_one_replica(cluster):
    _, gw = cluster
    port, port1, replay, replay1 = free_ports(4)
    spec = f"tcp://127.0.0.1:{port},replay=tcp://127.0.0.1:{replay},dp_size=2"
    pub0, _ = publisher(port, replay, rank=0)
    pub1, _ = publisher(port, replay, rank=1)  # vLLM offsets both ports by the rank
    assert pub1.endpoint.endswith(f":{port1}") and pub1.replay_endpoint.endswith(f":{replay1}")
    try:
        follow(cluster, spec)
        until(gw, lambda r: r["kv_events"]["connected_ranks"] == 2)
        shared = prompt(6, 3)
        batch, hashes = stored_batch(shared)
        pub0.publish(batch)
        pub1.publish(batch)  # the same prefix cached on both ranks
        pub1.publish(stored_batch(prompt(7, 2))[0])
        until(gw, lambda r: r["index_blocks"] == 5)
        pub0.publish(KVEventBatch(time.time(), [BlockRemoved(hashes, "GPU")]))
        time.sleep(0.5)
        assert row(gw)["index_blocks"] == 5  # rank 1 still holds the shared prefix
        assert predicted(gw, shared + [1, 2]) == 3 * BS
    finally:
        pub0.shutdown()
        pub1.shutdown()


def test_bad_messages_are_counted_and_the_feed_keeps_running(cluster):
    upstream, gw = cluster
    port, replay = free_ports(2)
    pub, faulty = publisher(port, replay)
    try:
        follow(cluster, f"tcp://127.0.0.1:{port},replay=tcp://127.0.0.1:{replay}")
        until(gw, lambda r: r["index_mode"] == "exact (zmq)")
        time.sleep(0.3)
        faulty.extra = [[b"", b"\x00\x01"], [b"", b"short", b"x"]]  # wrong frame count, bad seq
        faulty.corrupt = 1  # a payload that is not a batch
        pub.publish(stored_batch(prompt(8, 2))[0])
        pub.publish(stored_batch(prompt(9, 3))[0])
        r = until(gw, lambda r: r["kv_events"]["bad_messages"] == 3 and r["index_blocks"] == 3)
        assert "not a KV event batch" in r["kv_events"]["last_error"]
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'kvgate_gateway_kv_feed_events_total{kind="bad_messages",replica=' in metrics
        assert "dropped a bad KV event message" in gw.log.read_text()
    finally:
        pub.shutdown()


def test_bad_kv_events_specs_are_refused(cluster):
    upstream, gw = cluster
    bad = procs.admin(gw, "/replicas", "POST", json={"url": upstream.url, "kv_events": "tcp://*:5557"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_events"
    assert "bind address" in bad.json()["error"]["message"]
