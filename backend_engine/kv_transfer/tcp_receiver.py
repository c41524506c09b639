"""The decode side of the CPU transport: one thread, one pyzmq ROUTER socket that every prefill
replica connects to.

A transfer opens with `begin`; the engine thread holds what is cached and reserves blocks for
the rest, and the answer goes back as `accept` (which blocks to send, how many chunks may be
unacknowledged). `end` is acknowledged with `done` at once; the registration it posts to the
engine thread runs before that thread picks up anything that follows from the acknowledgement. Each block frame is checked against its checksum and written straight into its
reserved block; one bad checksum fails the whole transfer (nothing enters the cache) and tells
the sender. A transfer that hears nothing from its sender for `timeout_s` fails the same way, so
a sender that died never leaves blocks reserved."""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field

import zmq

from backend_engine.kv_transfer import wire
from backend_engine.kv_transfer.base import KVReceiver, ReceiverEvents, Reservation
from backend_engine.kv_transfer.block_io import BlockIO
from backend_engine.kv_transfer.wake_pipe import WakePipe

log = logging.getLogger("kvgate.kv_transfer")

RESERVING, RECEIVING = "reserving", "receiving"


@dataclass(slots=True)
class _In:
    transfer_id: str
    peer: bytes
    hashes: list[int]
    deadline: float
    state: str = RESERVING
    aborted: bool = False  # the sender gave up while the engine was reserving
    block_of: dict[int, int] = field(default_factory=dict)  # block index → reserved block id
    received: set[int] = field(default_factory=set)


@dataclass(slots=True)
class ReceiverStats:
    transfers_failed: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    checksum_failures: int = 0


class TcpKVReceiver(KVReceiver):
    def __init__(self, io: BlockIO, events: ReceiverEvents, host: str = "127.0.0.1",
                 port: int = 0, advertise: str | None = None, timeout_s: float = 10.0,
                 window: int = 4, max_transfers: int = 16):
        self.io = io
        self.events = events
        self.timeout_s = timeout_s
        self.window = window
        self.max_transfers = max_transfers
        self.stats = ReceiverStats()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.port = port
        self._address = advertise or f"tcp://{_reachable(host)}:{port}"
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = WakePipe()
        self._transfers: dict[str, _In] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvgate-kv-receiver", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return self._address

    @property
    def in_flight(self) -> int:
        return len(self._transfers)

    def shutdown(self) -> None:
        self._stopping = True
        self._notify(("noop", "", None))
        self._thread.join(timeout=10)

    def _notify(self, item: tuple) -> None:
        """From the engine thread: a reservation or completion is ready."""
        self._replies.put(item)
        self._wake.wake()

    # -- the receiver thread -----------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake.fd, zmq.POLLIN)
        try:
            while not self._stopping:
                for sock, _ in poller.poll(100 if self._transfers else 500):
                    if sock == self._wake.fd:
                        self._wake.drain()
                    else:
                        self._read_requests()
                self._apply_replies()
                self._check_deadlines(time.monotonic())
        except Exception:  # noqa: BLE001 - free every reservation rather than leak it
            log.exception("kv receiver thread failed")
        finally:
            for entry in list(self._transfers.values()):
                self._fail(entry, "the receiver stopped", "aborted", tell_peer=False)
            self._sock.close(linger=0)
            self._ctx.term()
            self._wake.close()

    def _read_requests(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            peer = frames[0].bytes
            try:
                message = wire.decode(frames[1].buffer)
            except ValueError:
                log.warning("ignoring an undecodable kv-transfer message")
                continue
            self._dispatch(peer, message, frames[2:])

    def _dispatch(self, peer: bytes, message: wire.Message, frames: list[zmq.Frame]) -> None:
        if isinstance(message, wire.Begin):
            self._begin(peer, message)
            return
        if isinstance(message, wire.Ping):
            for transfer_id in message.ids:
                entry = self._transfers.get(transfer_id)
                if entry is not None and entry.peer == peer:
                    entry.deadline = time.monotonic() + self.timeout_s
            return
        entry = self._transfers.get(message.id)
        if entry is None or entry.peer != peer:
            return  # a transfer that already ended (failed or timed out): drop its leftovers
        entry.deadline = time.monotonic() + self.timeout_s
        if isinstance(message, wire.Data):
            self._data(entry, message, frames)
        elif isinstance(message, wire.End):
            if entry.state != RECEIVING:
                self._fail(entry, "end before the transfer was accepted", "protocol")
                return
            # The engine thread registers the blocks before it runs anything the sender's
            # answer leads to, so the acknowledgement need not wait for it.
            del self._transfers[entry.transfer_id]
            self.events.complete(entry.transfer_id, sorted(entry.received))
            self._reply(entry.peer, wire.Done(entry.transfer_id, len(entry.received)))
        elif isinstance(message, wire.Abort):
            if entry.state == RESERVING:
                entry.aborted = True  # free once the reservation exists
            else:
                self._fail(entry, f"the sender aborted: {message.reason}", "aborted",
                           tell_peer=False)

    def _begin(self, peer: bytes, message: wire.Begin) -> None:
        def refuse(reason: str, code: str) -> None:
            self._reply(peer, wire.Error(message.id, reason, code))

        if message.layout != self.io.layout:
            refuse(f"KV layout {message.layout} differs from this replica's {self.io.layout}",
                   "layout_mismatch")
        elif message.id in self._transfers:
            refuse("duplicate transfer id", "protocol")
        elif len(self._transfers) >= self.max_transfers:
            refuse(f"{self.max_transfers} transfers in flight already", "busy")
        else:
            entry = _In(message.id, peer, message.hashes, time.monotonic() + self.timeout_s)
            self._transfers[message.id] = entry
            transfer_id = message.id
            self.events.reserve(transfer_id, list(message.hashes),
                                lambda r: self._notify(("reserved", transfer_id, r)))

    def _data(self, entry: _In, message: wire.Data, frames: list[zmq.Frame]) -> None:
        if entry.state != RECEIVING or len(message.blocks) != len(frames):
            self._fail(entry, "unexpected data", "protocol")
            return
        block_ids, buffers = [], []
        for (index, expected), frame in zip(message.blocks, frames):
            block_id = entry.block_of.get(index)
            if block_id is None or frame.buffer.nbytes != self.io.layout.block_bytes:
                self._fail(entry, f"block {index} was not asked for or has the wrong size",
                           "protocol")
                return
            if wire.checksum(frame.buffer) != expected:
                self.stats.checksum_failures += 1
                self._fail(entry, f"block {index} failed its checksum", "checksum")
                return
            block_ids.append(block_id)
            buffers.append(frame.buffer)
        self.io.write(block_ids, self.io.from_frames(buffers))
        entry.received.update(index for index, _ in message.blocks)
        self.stats.blocks_received += len(block_ids)
        self.stats.bytes_received += sum(b.nbytes for b in buffers)
        self._reply(entry.peer, wire.Ack(entry.transfer_id, message.seq))

    def _apply_replies(self) -> None:
        while True:
            try:
                kind, transfer_id, value = self._replies.get_nowait()
            except queue.Empty:
                return
            entry = self._transfers.get(transfer_id)
            if entry is None:  # it failed while the engine was reserving: free what it got
                if kind == "reserved" and value.error is None:
                    self.events.fail(transfer_id, "the transfer ended while reserving")
                continue
            if kind == "reserved":
                self._reserved(entry, value)

    def _reserved(self, entry: _In, reservation: Reservation) -> None:
        if reservation.error is not None:
            del self._transfers[entry.transfer_id]
            self.stats.transfers_failed += 1
            self._reply(entry.peer, wire.Error(entry.transfer_id, reservation.error, "rejected"))
            return
        entry.block_of = dict(zip(reservation.need, reservation.block_ids))
        entry.state = RECEIVING
        entry.deadline = time.monotonic() + self.timeout_s
        if entry.aborted:
            self._fail(entry, "the sender aborted", "aborted", tell_peer=False)
            return
        self._reply(entry.peer, wire.Accept(entry.transfer_id, reservation.need, self.window))

    def _check_deadlines(self, now: float) -> None:
        for entry in list(self._transfers.values()):
            if entry.state == RECEIVING and now > entry.deadline:
                self._fail(entry, f"nothing from the sender for {self.timeout_s:g}s", "timeout")

    def _fail(self, entry: _In, reason: str, code: str, tell_peer: bool = True) -> None:
        self._transfers.pop(entry.transfer_id, None)
        self.stats.transfers_failed += 1
        log.warning("kv transfer %s failed: %s", entry.transfer_id, reason)
        if entry.state != RESERVING:  # while reserving, the reservation reply frees it
            self.events.fail(entry.transfer_id, reason)
        if tell_peer:
            self._reply(entry.peer, wire.Error(entry.transfer_id, reason, code))

    def _reply(self, peer: bytes, message: wire.Message) -> None:
        try:
            self._sock.send_multipart([peer, wire.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError:  # the peer is gone or not reading: its own timeout covers it
            pass


def _reachable(host: str) -> str:
    """The address peers dial for a bind host; for a wildcard, this machine's own address."""
    if host not in ("0.0.0.0", "::", "*", ""):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
