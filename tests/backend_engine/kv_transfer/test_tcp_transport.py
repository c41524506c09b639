"""The CPU transport on loopback: blocks arrive bit-exact and enter the cache; corruption,
silence, refusal and aborts fail the transfer on both sides and leave nothing reserved; the
sender never has more than `window` chunks unacknowledged."""

import threading
import time

import pytest
import torch
import zmq

from backend_engine.block_pool import BlockPool
from backend_engine.kv_transfer import wire
from backend_engine.kv_transfer.base import ReceiverEvents, SendSpec, SenderEvents
from backend_engine.kv_transfer.block_io import BlockIO
from backend_engine.kv_transfer.imports import KVImports
from backend_engine.kv_transfer.tcp_receiver import TcpKVReceiver
from backend_engine.kv_transfer.tcp_sender import TcpKVSender
from routing.hashing import block_hashes

NUM_BLOCKS, BLOCK_SIZE, LAYERS, HEADS, DIM = 32, 4, 2, 2, 8
HASHES = block_hashes(list(range(6 * BLOCK_SIZE)), "m", BLOCK_SIZE)


def kv_caches(seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(LAYERS)]


class DecodeSide(ReceiverEvents):
    """A decode engine's bookkeeping, called straight from the receiver thread."""

    def __init__(self):
        self.pool = BlockPool(NUM_BLOCKS)
        self.imports = KVImports(self.pool)
        self.caches = kv_caches(1)
        self.lock = threading.Lock()
        self.failed = threading.Event()

    def reserve(self, transfer_id, hashes, reply):
        with self.lock:
            reply(self.imports.reserve(transfer_id, hashes))

    def complete(self, transfer_id, received):
        with self.lock:
            self.imports.complete(transfer_id, received)

    def fail(self, transfer_id, reason):
        with self.lock:
            self.imports.fail(transfer_id)
        self.failed.set()

    def all_free(self) -> bool:
        with self.lock:
            return self.pool.num_free_blocks == NUM_BLOCKS


class PrefillSide(SenderEvents):
    def __init__(self):
        self.released_ids: list[int] = []
        self.results = {}
        self.done = threading.Event()

    def released(self, transfer_id, block_ids):
        self.released_ids += block_ids

    def finished(self, transfer_id, result):
        self.results[transfer_id] = result
        self.done.set()


@pytest.fixture()
def decode():
    side = DecodeSide()
    receiver = TcpKVReceiver(BlockIO(side.caches, "m"), side, timeout_s=0.5, window=2)
    yield side, receiver
    receiver.shutdown()


@pytest.fixture()
def prefill():
    side = PrefillSide()
    caches = kv_caches(0)
    sender = TcpKVSender(BlockIO(caches, "m"), side, timeout_s=1.0, chunk_bytes=2048)
    yield side, sender, caches
    sender.shutdown()


def wait_for(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def send_all(sender, address, block_ids, layout):
    sender.start(SendSpec("t", address, HASHES, layout))
    sender.offer("t", list(enumerate(block_ids)))
    sender.close("t")


def test_blocks_arrive_bit_exact_and_enter_the_cache(prefill, decode):
    (p, sender, p_caches), (d, receiver) = prefill, decode
    source = [7, 3, 11, 0, 5, 9]
    send_all(sender, receiver.address, source, sender.io.layout)
    assert p.done.wait(5)
    result = p.results["t"]
    assert result.ok and result.blocks_sent == 6 and result.bytes_sent == 6 * sender.io.layout.block_bytes
    assert sorted(p.released_ids) == sorted(source)  # every hold can be dropped
    claimed = d.imports.claim("t")
    assert [b.block_hash for b in claimed] == HASHES
    for block, src in zip(claimed, source):
        for (pk, pv), (dk, dv) in zip(p_caches, d.caches):
            assert torch.equal(dk[block.block_id], pk[src]) and torch.equal(dv[block.block_id], pv[src])
    d.imports.release(claimed)
    assert d.all_free()


def test_only_blocks_the_receiver_lacks_are_sent(prefill, decode):
    (p, sender, _), (d, receiver) = prefill, decode
    cached = d.pool.allocate(2)
    for block, h in zip(cached, HASHES[:2]):
        d.pool.cache_block(block, h)
    d.pool.release(cached)
    send_all(sender, receiver.address, list(range(6)), sender.io.layout)
    assert p.done.wait(5)
    assert p.results["t"].blocks_needed == 4 and p.results["t"].blocks_sent == 4


def test_a_corrupted_block_fails_the_transfer_and_frees_the_reservation(prefill, decode):
    (p, sender, _), (d, receiver) = prefill, decode
    honest = sender._send

    def corrupting(out, message, frames=()):  # one bit flips on the wire, after the checksum
        if frames:
            frames = [*frames[:-1], bytearray(frames[-1])]
            frames[-1][17] ^= 0x40
        return honest(out, message, frames)

    sender._send = corrupting
    send_all(sender, receiver.address, list(range(6)), sender.io.layout)
    assert p.done.wait(5)
    result = p.results["t"]
    assert not result.ok and result.error_code == "checksum"
    assert wait_for(d.all_free)
    assert not any(d.pool.lookup(h) for h in HASHES)  # nothing half-written entered the cache
    assert receiver.stats.checksum_failures == 1


def test_a_sender_that_goes_silent_is_timed_out_and_its_blocks_freed(decode):
    d, receiver = decode
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(receiver.address)
    sock.send(wire.encode(wire.Begin("t", BlockIO(d.caches, "m").layout, HASHES)))
    assert sock.poll(5000)
    assert isinstance(wire.decode(sock.recv()), wire.Accept)
    assert not d.all_free()  # reserved, then the sender "dies"
    assert d.failed.wait(5)
    assert wait_for(d.all_free)
    sock.close(linger=0)
    ctx.term()


def test_a_receiver_that_never_answers_times_the_sender_out(prefill):
    p, sender, _ = prefill
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as silent:
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        send_all(sender, f"tcp://127.0.0.1:{port}", list(range(6)), sender.io.layout)
        assert p.done.wait(5)
        silent.close(linger=0)
    assert p.results["t"].error_code == "timeout"
    assert sorted(p.released_ids) == []  # nothing was read out; the engine drops the holds


def test_at_most_window_chunks_are_unacknowledged(prefill):
    p, sender, _ = prefill
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as router:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        sender.start(SendSpec("t", f"tcp://127.0.0.1:{port}", HASHES, sender.io.layout))
        sender.offer("t", list(enumerate(range(6))))  # chunk_bytes=2048: two blocks a chunk
        peer, header = router.recv_multipart()
        router.send_multipart([peer, wire.encode(wire.Accept("t", list(range(6)), 1))])
        got = []
        while router.poll(300):
            got.append(wire.decode(router.recv_multipart()[1]))
        assert [type(m) for m in got] == [wire.Data]  # the window is full: no second chunk
        router.send_multipart([peer, wire.encode(wire.Ack("t", 0))])
        assert router.poll(2000)
        assert isinstance(wire.decode(router.recv_multipart()[1]), wire.Data)
        sender.abort("t", "test over")
        router.close(linger=0)


def test_a_layout_mismatch_is_refused(prefill, decode):
    (p, sender, _), (d, receiver) = prefill, decode
    wrong = wire.KVLayout("other-model", BLOCK_SIZE, LAYERS, HEADS, DIM, "float32")
    send_all(sender, receiver.address, list(range(6)), wrong)
    assert p.done.wait(5)
    assert p.results["t"].error_code == "layout_mismatch"
    assert d.all_free()


def test_an_abort_frees_the_receivers_reservation(prefill, decode):
    (p, sender, _), (d, receiver) = prefill, decode
    sender.start(SendSpec("t", receiver.address, HASHES, sender.io.layout))
    assert wait_for(lambda: not d.all_free())
    sender.abort("t", "the client left")
    assert p.done.wait(5) and p.results["t"].error_code == "aborted"
    assert wait_for(d.all_free)


def test_a_sender_bounds_unacknowledged_chunks_over_all_its_transfers():
    side = PrefillSide()
    sender = TcpKVSender(BlockIO(kv_caches(0), "m"), side, timeout_s=2.0, chunk_bytes=2048,
                         max_unacked=1)
    try:
        with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as router:
            port = router.bind_to_random_port("tcp://127.0.0.1")
            for tid in ("a", "b"):
                sender.start(SendSpec(tid, f"tcp://127.0.0.1:{port}", HASHES, sender.io.layout))
                sender.offer(tid, list(enumerate(range(6))))
            for _ in range(2):
                peer, header = router.recv_multipart()
                tid = wire.decode(header).id
                router.send_multipart([peer, wire.encode(wire.Accept(tid, list(range(6)), 4))])
            got = []
            while router.poll(300):
                got.append(wire.decode(router.recv_multipart()[1]))
            assert len(got) == 1  # one chunk in flight in all, though each transfer allows four
            router.close(linger=0)
    finally:
        sender.shutdown()
