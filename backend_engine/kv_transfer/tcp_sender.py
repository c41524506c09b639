"""The prefill side of the CPU transport: one thread, one pyzmq DEALER socket per decode
replica, any number of transfers multiplexed over it.

Memory is bounded: a block's data is read out of the KV cache only when it is about to be sent
(its hold is dropped right after), chunks are at most `chunk_bytes`, at most `window` chunks per
transfer wait for the receiver's acknowledgement, and at most `max_unacked` over all transfers. A receiver that does not answer
within `timeout_s` fails the transfer; while the prompt is still computing, pings keep the
receiver from timing out."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import zmq

from backend_engine.kv_transfer import wire
from backend_engine.kv_transfer.base import KVSender, SenderEvents, SendSpec, TransferResult
from backend_engine.kv_transfer.block_io import BlockIO
from backend_engine.kv_transfer.wake_pipe import WakePipe

log = logging.getLogger("kvgate.kv_transfer")


@dataclass(slots=True)
class _Out:
    spec: SendSpec
    started: float
    deadline: float  # the receiver must answer by then (while we wait on it)
    pending: deque[tuple[int, int]] = field(default_factory=deque)  # offered, not yet sent
    need: set[int] | None = None  # None until the receiver accepts
    window: int = 1
    unacked: int = 0
    seq: int = 0
    blocks_sent: int = 0
    bytes_sent: int = 0
    closed: bool = False  # every block has been offered
    closed_at: float | None = None
    ended: bool = False  # `end` sent; waiting for `done`
    last_sent: float = 0.0

    @property
    def waiting_on_peer(self) -> bool:
        return self.need is None or self.unacked > 0 or self.ended


class TcpKVSender(KVSender):
    def __init__(self, io: BlockIO, events: SenderEvents, timeout_s: float = 10.0,
                 chunk_bytes: int = 4 << 20, max_unacked: int = 16):
        self.io = io
        self.max_unacked = max_unacked
        self.events = events
        self.timeout_s = timeout_s
        self.chunk_blocks = max(1, chunk_bytes // io.layout.block_bytes)
        self._ctx = zmq.Context()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = WakePipe()
        self._sockets: dict[str, zmq.Socket] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._wake.fd, zmq.POLLIN)
        self._transfers: dict[str, _Out] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvgate-kv-sender", daemon=True)
        self._thread.start()

    # -- any thread --------------------------------------------------------------------------
    def start(self, spec: SendSpec) -> None:
        self._put(("start", spec))

    def offer(self, transfer_id: str, blocks: list[tuple[int, int]]) -> None:
        self._put(("offer", transfer_id, blocks))

    def close(self, transfer_id: str) -> None:
        self._put(("close", transfer_id))

    def abort(self, transfer_id: str, reason: str) -> None:
        self._put(("abort", transfer_id, reason))

    def shutdown(self) -> None:
        self._stopping = True
        self._put(("noop",))
        self._thread.join(timeout=10)

    @property
    def in_flight(self) -> int:
        return len(self._transfers)

    def _put(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.wake()

    # -- the sender thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                for sock, _ in self._poller.poll(self._poll_ms()):
                    if sock == self._wake.fd:
                        self._wake.drain()
                    else:
                        self._read_replies(sock)
                self._apply_commands()
                now = time.monotonic()
                for out in list(self._transfers.values()):
                    self._pump(out, now)
                self._check_deadlines(now)
        except Exception:  # noqa: BLE001 - report every transfer as failed, never hang them
            log.exception("kv sender thread failed")
        finally:
            for out in list(self._transfers.values()):
                self._finish(out, False, "the sender stopped", "aborted")
            for sock in self._sockets.values():
                sock.close(linger=0)
            self._ctx.term()
            self._wake.close()

    def _poll_ms(self) -> int:
        return 50 if self._transfers else 500

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "start":
                self._begin(command[1])
                continue
            out = self._transfers.get(command[1]) if len(command) > 1 else None
            if kind == "offer":
                if out is not None:
                    out.pending.extend(command[2])
                else:  # the transfer already ended: nobody will read these blocks
                    self.events.released(command[1], [b for _, b in command[2]])
            elif kind == "close" and out is not None:
                out.closed = True
                out.closed_at = time.monotonic()
            elif kind == "abort" and out is not None:
                self._send(out, wire.Abort(out.spec.transfer_id, command[2]))
                self._finish(out, False, command[2], "aborted")

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._sockets[address] = sock
            self._poller.register(sock, zmq.POLLIN)
        return sock

    def _drop_socket(self, address: str) -> None:
        """Forget a peer that stopped answering, and whatever was queued for it."""
        if any(o.spec.address == address for o in self._transfers.values()):
            return
        sock = self._sockets.pop(address, None)
        if sock is not None:
            self._poller.unregister(sock)
            sock.close(linger=0)

    def _begin(self, spec: SendSpec) -> None:
        now = time.monotonic()
        out = _Out(spec, now, now + self.timeout_s)
        self._transfers[spec.transfer_id] = out
        self._send(out, wire.Begin(spec.transfer_id, spec.layout, spec.hashes, spec.hint))

    def _send(self, out: _Out, message: wire.Message, frames: list[memoryview] = ()) -> bool:
        try:
            self._socket(out.spec.address).send_multipart([wire.encode(message), *frames],
                                                          flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._finish(out, False, "the decode replica is not taking data", "timeout")
            return False
        out.last_sent = time.monotonic()
        return True

    def _read_replies(self, sock: zmq.Socket) -> None:
        while True:
            try:
                header = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = wire.decode(header)
            except ValueError:
                log.warning("ignoring an undecodable kv-transfer reply")
                continue
            out = self._transfers.get(getattr(message, "id", ""))
            if out is not None:
                self._on_reply(out, message)

    def _on_reply(self, out: _Out, message: wire.Message) -> None:
        out.deadline = time.monotonic() + self.timeout_s
        if isinstance(message, wire.Accept):
            out.need = set(message.need)
            out.window = max(1, message.window)
        elif isinstance(message, wire.Ack):
            out.unacked = max(0, out.unacked - 1)
        elif isinstance(message, wire.Done):
            self._finish(out, True)
        elif isinstance(message, wire.Error):
            self._finish(out, False, f"the decode replica refused: {message.reason}", message.code)

    def _pump(self, out: _Out, now: float) -> None:
        """Send what the window allows; drop blocks the receiver does not need."""
        if out.need is None or out.spec.transfer_id not in self._transfers:
            return
        while out.pending and out.unacked < out.window and self._unacked() < self.max_unacked:
            batch, unneeded = [], []
            while out.pending and len(batch) < self.chunk_blocks:
                index, block_id = out.pending.popleft()
                (batch if index in out.need else unneeded).append((index, block_id))
            if unneeded:
                self.events.released(out.spec.transfer_id, [b for _, b in unneeded])
            if not batch:
                continue
            chunk = self.io.read([b for _, b in batch])
            self.events.released(out.spec.transfer_id, [b for _, b in batch])
            frames = self.io.frames(chunk)
            header = wire.Data(out.spec.transfer_id, out.seq,
                               [(index, wire.checksum(f)) for (index, _), f in zip(batch, frames)])
            if not self._send(out, header, frames):
                return
            out.seq += 1
            out.unacked += 1
            out.blocks_sent += len(batch)
            out.bytes_sent += sum(f.nbytes for f in frames)
            out.deadline = now + self.timeout_s
        if out.closed and not out.pending and not out.ended:
            out.ended = True
            out.deadline = now + self.timeout_s
            self._send(out, wire.End(out.spec.transfer_id, out.blocks_sent))

    def _unacked(self) -> int:
        return sum(o.unacked for o in self._transfers.values())

    def _check_deadlines(self, now: float) -> None:
        idle: dict[str, list[str]] = {}
        for out in list(self._transfers.values()):
            if out.waiting_on_peer and now > out.deadline:
                self._finish(out, False, f"the decode replica did not answer within "
                                         f"{self.timeout_s:g}s", "timeout")
                self._drop_socket(out.spec.address)
            elif not out.waiting_on_peer and now - out.last_sent > self.timeout_s / 3:
                idle.setdefault(out.spec.address, []).append(out.spec.transfer_id)
        for address, ids in idle.items():  # still computing: tell the receiver we are alive
            try:
                self._socket(address).send(wire.encode(wire.Ping(ids)), zmq.NOBLOCK)
            except zmq.Again:
                continue  # the deadlines above catch a receiver that stays unreachable
            for transfer_id in ids:
                self._transfers[transfer_id].last_sent = now

    def _finish(self, out: _Out, ok: bool, error: str | None = None,
                code: str | None = None) -> None:
        if self._transfers.pop(out.spec.transfer_id, None) is None:
            return
        now = time.monotonic()
        result = TransferResult(out.spec.transfer_id, ok, len(out.need or ()), out.blocks_sent,
                                out.bytes_sent, now - (out.closed_at or out.started),
                                now - out.started, error, code, now)
        if not ok:
            log.warning("kv transfer %s to %s failed: %s", out.spec.transfer_id,
                        out.spec.address, error)
        self.events.finished(out.spec.transfer_id, result)
