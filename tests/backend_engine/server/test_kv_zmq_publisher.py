"""A kvgate replica's ZMQ KV events (`--kv-events-config`): the block pool's steps become vLLM
batches whose blocks map back to the same canonical hashes, published and replayed as vLLM's
ZmqEventPublisher does."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from backend_engine.block_pool import BlockOrigin, BlockPool
from backend_engine.server.kv_publisher import KVEventsConfig, ZmqEventPublisher
from backend_engine.server.kv_zmq_events import to_batch
from protocol.kv_events import AllBlocksCleared, BatchDecoder, BlockRemoved, BlockStored, KVEventBatch
from routing.engine_blocks import EngineBlockMap
from routing.hashing import block_hashes, namespace_for
from tests.gateway.zmq_publishers import free_ports

MODEL = "tiny"


def cached_step(pool: BlockPool, tokens: list[int], namespace: str) -> list[int]:
    hashes = block_hashes(tokens, namespace, 16)
    blocks = pool.allocate(len(hashes))
    for i, (block, h) in enumerate(zip(blocks, hashes)):
        pool.cache_block(block, h, BlockOrigin(hashes[i - 1] if i else None,
                                               tuple(tokens[i * 16:(i + 1) * 16]), namespace))
    pool.release(list(reversed(blocks)))
    return hashes


def test_pool_steps_become_vllm_batches_that_map_back_to_the_same_hashes():
    pool = BlockPool(8)
    pool.keep_origins = True
    plain = cached_step(pool, list(range(48)), MODEL)
    salted = cached_step(pool, list(range(32)), namespace_for(MODEL, "tenant:a"))
    batch = to_batch(pool.flush_events(), MODEL, 16, "CPU")
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [3, 2]  # one event per chain
    assert stored[0].parent_block_hash is None and stored[0].extra_keys is None
    assert stored[1].extra_keys == [("tenant:a",), None]  # the salt, as vLLM sends cache_salt
    mapper = EngineBlockMap(MODEL, 16)
    assert mapper.apply(batch).stored == plain + salted
    pool.reset_prefix_cache()
    cleared = to_batch(pool.flush_events(), MODEL, 16, "CPU")
    assert isinstance(cleared.events[0], AllBlocksCleared)


def test_evictions_are_published_as_block_removed():
    pool = BlockPool(3)
    pool.keep_origins = True
    first = cached_step(pool, list(range(48)), MODEL)
    pool.flush_events()
    pool.allocate(1)  # takes the least recently freed cached block
    batch = to_batch(pool.flush_events(), MODEL, 16, "GPU")
    assert batch.events == [BlockRemoved([first[2]], "GPU")]


def test_publisher_streams_and_replays_like_vllm():
    port, replay = free_ports(2)
    config = KVEventsConfig.from_json(
        f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{port}", '
        f'"replay_endpoint": "tcp://*:{replay}", "topic": "kv"}}')
    pub = ZmqEventPublisher(config)
    ctx = zmq.Context.instance()
    sub, dealer = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)
        for i in range(3):
            pub.publish(KVEventBatch(float(i), [AllBlocksCleared()]))
        assert sub.poll(5000)
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and int.from_bytes(seq, "big") == 0
        assert BatchDecoder().decode(payload).data_parallel_rank == 0
        for expected in (1, 2):  # every batch published (so buffered) before asking to replay
            assert sub.poll(5000)
            assert int.from_bytes(sub.recv_multipart()[1], "big") == expected
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        answers = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            answers.append(frames)
            if int.from_bytes(frames[2], "big", signed=True) == -1:
                break
        assert [int.from_bytes(f[2], "big") for f in answers[:-1]] == [1, 2]
        assert answers[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
        assert msgspec.msgpack.decode(answers[0][3])[0] == 1.0
    finally:
        sub.close(0)
        dealer.close(0)
        pub.shutdown()


@pytest.mark.parametrize("text, message", [
    ("{", "not JSON"), ("[]", "JSON object"), ('{"endpoint": "x", "nope": 1}', "unknown fields"),
    ('{"publisher": "kafka"}', "unknown publisher"), ('{"buffer_steps": 0}', "positive"),
])
def test_bad_configs_are_refused_at_start(text, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.from_json(text)


def test_disabled_config_publishes_nothing():
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').enabled
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}').enabled
