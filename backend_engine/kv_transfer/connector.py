"""The engine's side of KV transfer, by replica role.

prefill: requests with RemoteDecode open a transfer (exports.py) streamed by the sender.
decode: a receiver accepts transfers into the block pool (imports.py); a request with
        RemotePrefill claims the blocks its transfer left held.
both:   no connector (the replica serves whole requests).

Every method here runs on the engine thread except the transport callbacks (`released`,
`finished`, `reserve`, `complete`, `fail`), which post their work to it."""

from __future__ import annotations

import logging
import queue
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from backend_engine.block_pool import BlockPool
from backend_engine.kv_block import KVBlock
from backend_engine.kv_transfer.base import ReceiverEvents, Reservation, SenderEvents, TransferResult
from backend_engine.kv_transfer.block_io import BlockIO
from backend_engine.kv_transfer.exports import KVExports
from backend_engine.kv_transfer.imports import KVImports
from backend_engine.kv_transfer.params import RemoteDecode, RemotePrefill
from backend_engine.sequence import Sequence

log = logging.getLogger("kvgate.kv_transfer")


@dataclass(slots=True)
class SendStats:
    transfers: Counter = field(default_factory=Counter)  # outcome ("ok" or an error code) → n
    blocks: int = 0
    bytes: int = 0
    seconds: list[float] = field(default_factory=list)  # per transfer, drained by metrics

    def record(self, result: TransferResult) -> None:
        self.transfers["ok" if result.ok else (result.error_code or "failed")] += 1
        self.blocks += result.blocks_sent
        self.bytes += result.bytes_sent
        if result.ok and len(self.seconds) < 100_000:
            self.seconds.append(result.seconds)


class KVConnector(SenderEvents, ReceiverEvents):
    def __init__(self, config, pool: BlockPool, kv_caches, model_id: str):  # noqa: ANN001
        from backend_engine.kv_transfer.tcp_receiver import TcpKVReceiver
        from backend_engine.kv_transfer.tcp_sender import TcpKVSender

        self.role = config.kv_role
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # work the transports post
        self.wake: Callable[[], None] = lambda: None  # the async engine wakes its loop with it
        io = BlockIO(kv_caches, model_id)
        self.layout = io.layout
        self.sender = self.exports = self.receiver = self.imports = None
        self.sent = SendStats()
        self._results: dict[str, object] = {}  # transfer id → Future[TransferResult]
        self._claims: dict[str, list[KVBlock]] = {}  # seq id → blocks its transfer left held
        self._awaiting: dict[str, str] = {}  # transfer id → seq id, for a claim made before
        # the transfer's completion was applied (the seq takes the blocks when it is)
        if self.role == "prefill":
            self.sender = TcpKVSender(io, self, config.kv_transfer_timeout_s,
                                      config.kv_transfer_chunk_bytes)
            self.exports = KVExports(pool, config.block_size, self.sender, io.layout)
        elif self.role == "decode":
            self.imports = KVImports(pool, claim_ttl_s=config.kv_transfer_timeout_s)
            self.receiver = TcpKVReceiver(io, self, config.kv_transfer_host or "127.0.0.1",
                                          config.kv_transfer_port, config.kv_transfer_address,
                                          config.kv_transfer_timeout_s,
                                          config.kv_transfer_window)

    # -- engine thread ---------------------------------------------------------------------
    def on_add(self, seqs: list[Sequence], params: RemoteDecode | RemotePrefill | None) -> None:
        if isinstance(params, RemoteDecode):
            self._results[params.transfer_id] = params.result
            self.exports.begin(seqs[0], params)
        elif isinstance(params, RemotePrefill) and params.transfer_id and self.imports:
            blocks = self.imports.claim(params.transfer_id)
            if blocks:
                self._claims[seqs[0].seq_id] = blocks
            elif self.imports.in_flight_id(params.transfer_id):
                self._awaiting[params.transfer_id] = seqs[0].seq_id

    def on_computed(self, seq: Sequence) -> None:
        if self.exports is not None:
            self.exports.on_computed(seq)

    def on_finish(self, seq: Sequence, reason: str) -> None:
        if self.exports is not None:
            unstarted = self.exports.on_finish(seq, reason)
            if unstarted is not None:
                self._finished(unstarted, TransferResult(unstarted, False, error="aborted while queued",
                                                         error_code="aborted"))
        blocks = self._claims.pop(seq.seq_id, None)
        if blocks:
            self.imports.release(blocks)
        for transfer_id in [t for t, s in self._awaiting.items() if s == seq.seq_id]:
            del self._awaiting[transfer_id]

    def housekeeping(self) -> None:
        """Run what the transports posted, then drop claims nobody took in time."""
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                break
            try:
                fn()
            except Exception:  # noqa: BLE001 - one bad callback must not stop the engine
                log.exception("kv-transfer work on the engine thread failed")
        if self.imports is not None:
            self.imports.expire()

    def load(self) -> dict:
        out = {"role": self.role, "in_flight": 0, "held_blocks": 0}
        if self.receiver is not None:
            s = self.receiver.stats
            out.update(address=self.receiver.address, in_flight=self.imports.in_flight,
                       held_blocks=self.imports.held_blocks + sum(map(len, self._claims.values())),
                       blocks_received=s.blocks_received, bytes_received=s.bytes_received,
                       transfers_failed=s.transfers_failed, checksum_failures=s.checksum_failures,
                       blocks_imported=self.imports.blocks_imported)
        if self.sender is not None:
            out.update(in_flight=len(self._results), held_blocks=self.exports.held_blocks,
                       blocks_sent=self.sent.blocks, bytes_sent=self.sent.bytes,
                       transfers=dict(self.sent.transfers))
        return out

    def drain_seconds(self) -> list[float]:
        """Per-transfer durations since the last call (for the metrics histogram)."""
        out, self.sent.seconds = self.sent.seconds, []
        return out

    def shutdown(self) -> None:
        for transport in (self.sender, self.receiver):
            if transport is not None:
                transport.shutdown()

    # -- transport threads: post to the engine thread ---------------------------------------
    def post(self, fn: Callable[[], None]) -> None:
        """Run fn on the engine thread before its next step (any thread may call this)."""
        self._inbox.put(fn)
        self.wake()

    def released(self, transfer_id: str, block_ids: list[int]) -> None:
        self.post(lambda: self.exports.released(transfer_id, block_ids))

    def finished(self, transfer_id: str, result: TransferResult) -> None:
        self.post(lambda: self._finished(transfer_id, result))

    def _finished(self, transfer_id: str, result: TransferResult) -> None:
        self.exports.finished(transfer_id)
        self.sent.record(result)
        future = self._results.pop(transfer_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    def reserve(self, transfer_id: str, hashes: list[int],
                reply: Callable[[Reservation], None]) -> None:
        self.post(lambda: reply(self.imports.reserve(transfer_id, hashes)))

    def complete(self, transfer_id: str, received: list[int]) -> None:
        self.post(lambda: self._complete(transfer_id, received))

    def _complete(self, transfer_id: str, received: list[int]) -> None:
        self.imports.complete(transfer_id, received)
        seq_id = self._awaiting.pop(transfer_id, None)
        if seq_id is not None:  # its request came first: it takes the holds now
            self._claims[seq_id] = self.imports.claim(transfer_id) or []

    def fail(self, transfer_id: str, reason: str) -> None:
        self.post(lambda: self.imports.fail(transfer_id))
