"""The KV-transfer interface: what a prefill replica's engine hands its transport (blocks to
send), what a decode replica's transport asks of its engine (blocks to fill), and what each
side hears back. The CPU implementation (tcp_sender.py, tcp_receiver.py) moves bytes over
TCP with pyzmq; a GPU implementation (NIXL/UCX or NCCL) would implement the same two classes
and move device memory instead (see docs/running/pd-disaggregation.md).

Threading: the engine thread owns the block pool. A transport runs its own thread(s) and
reaches the pool only through the `SenderEvents` / `ReceiverEvents` callbacks, which post to
the engine thread; it may read and write the KV tensors of blocks it holds directly, since
nothing else touches a held block that has no hash yet (decode side) or whose tokens are
computed and verified (prefill side)."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the wire format needs msgspec, which only a transferring replica loads
    from backend_engine.kv_transfer.wire import KVLayout


@dataclass(slots=True)
class SendSpec:
    """One transfer a prefill replica starts when it admits a request."""

    transfer_id: str
    address: str  # the decode replica's receiver, tcp://host:port
    hashes: list[int]  # canonical hashes of every full block of the prompt, in order
    layout: KVLayout
    hint: int = 0  # leading blocks the gateway's index believes the decode replica holds


@dataclass(slots=True)
class TransferResult:
    transfer_id: str
    ok: bool
    blocks_needed: int = 0  # blocks the decode replica lacked (what it asked for)
    blocks_sent: int = 0
    bytes_sent: int = 0
    # what the transfer added to the request: from the prefill's end (every block offered) to
    # the decode replica's acknowledgement; blocks computed earlier were sent meanwhile
    seconds: float = 0.0
    open_seconds: float = 0.0  # from the opening (request admitted) to the acknowledgement
    error: str | None = None
    error_code: str | None = None  # "rejected", "checksum", "timeout", "aborted", "peer_error"
    finished_at: float = 0.0  # time.monotonic() at the end

    def to_dict(self) -> dict:
        return {"blocks_needed": self.blocks_needed, "blocks_sent": self.blocks_sent,
                "bytes": self.bytes_sent, "seconds": round(self.seconds, 6),
                "open_seconds": round(self.open_seconds, 6)}


@dataclass(slots=True)
class Reservation:
    """The decode engine's answer to a transfer's opening: which block indexes to send and
    the block ids reserved for them (same order); empty `need` accepts nothing."""

    need: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    error: str | None = None  # set: refuse the transfer


class SenderEvents(abc.ABC):
    """What a sender reports; called from the transport's thread."""

    @abc.abstractmethod
    def released(self, transfer_id: str, block_ids: list[int]) -> None:
        """The data of these held blocks has been read out: the engine may drop its holds."""

    @abc.abstractmethod
    def finished(self, transfer_id: str, result: TransferResult) -> None:
        """The transfer ended (either way); every hold it still has may be dropped."""


class ReceiverEvents(abc.ABC):
    """What a receiver asks of its engine; called from the transport's thread. Replies come
    back through the callbacks, from the engine thread."""

    @abc.abstractmethod
    def reserve(self, transfer_id: str, hashes: list[int],
                reply: Callable[[Reservation], None]) -> None:
        """Hold the blocks already cached, reserve free blocks for the rest."""

    @abc.abstractmethod
    def complete(self, transfer_id: str, received: list[int]) -> None:
        """Register the received block indexes as cached (posted to the engine thread, which
        runs it before any request it picks up later)."""

    @abc.abstractmethod
    def fail(self, transfer_id: str, reason: str) -> None:
        """Free the transfer's reservations; nothing it received enters the cache."""


class KVSender(abc.ABC):
    """Producer side: streams a request's prompt blocks to a decode replica as they are
    computed, chunked, checksummed per block, with bounded memory in flight."""

    @abc.abstractmethod
    def start(self, spec: SendSpec) -> None: ...

    @abc.abstractmethod
    def offer(self, transfer_id: str, blocks: list[tuple[int, int]]) -> None:
        """(block index in the prompt, block id) pairs that are computed and held."""

    @abc.abstractmethod
    def close(self, transfer_id: str) -> None:
        """Every block has been offered; finish once the receiver has them."""

    @abc.abstractmethod
    def abort(self, transfer_id: str, reason: str) -> None: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    @property
    @abc.abstractmethod
    def in_flight(self) -> int: ...


class KVReceiver(abc.ABC):
    """Consumer side: accepts transfers and writes their blocks into reserved KV blocks."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where senders reach this receiver (advertised to gateways)."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    @property
    @abc.abstractmethod
    def in_flight(self) -> int: ...
