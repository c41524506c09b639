"""The prefill side's block bookkeeping (engine thread only).

A request with RemoteDecode opens its transfer when it starts computing (not while it queues:
the decode replica reserves blocks at the opening). After every step, the prompt's full blocks
its first sample has computed since are held (a reference each, so neither the request's end
nor eviction can reuse them) and offered to the sender, which streams them while later chunks
of the prompt still compute. The sender reports when it has read a block out; the hold is
dropped then. The request's end closes the transfer (or aborts it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend_engine.block_pool import BlockPool
from backend_engine.kv_block import KVBlock
from backend_engine.kv_transfer.base import KVSender, SendSpec
from backend_engine.kv_transfer.params import RemoteDecode
from backend_engine.kv_transfer.wire import KVLayout
from backend_engine.sequence import Sequence
from routing.hashing import block_hashes


@dataclass(slots=True)
class _Export:
    spec: SendSpec
    seq: Sequence
    started: bool = False  # the opening went to the sender
    offered: int = 0  # leading prompt blocks handed to the sender
    held: dict[int, KVBlock] = field(default_factory=dict)  # block id → held block


class KVExports:
    def __init__(self, pool: BlockPool, block_size: int, sender: KVSender, layout: KVLayout):
        self.pool = pool
        self.block_size = block_size
        self.sender = sender
        self.layout = layout
        self._by_seq: dict[str, _Export] = {}  # open transfers by their sequence
        self._by_id: dict[str, _Export] = {}  # every transfer whose holds are not all dropped

    @property
    def held_blocks(self) -> int:
        return sum(len(e.held) for e in self._by_id.values())

    def begin(self, seq: Sequence, remote: RemoteDecode) -> None:
        hashes = block_hashes(seq.prompt_token_ids, seq.namespace, self.block_size)
        spec = SendSpec(remote.transfer_id, remote.address, hashes, self.layout, remote.hint)
        export = _Export(spec, seq)
        self._by_seq[seq.seq_id] = export
        self._by_id[remote.transfer_id] = export

    def _start(self, export: _Export) -> None:
        if not export.started:
            export.started = True
            self.sender.start(export.spec)

    def on_computed(self, seq: Sequence) -> None:
        """Offer the prompt blocks `seq` finished computing in this step."""
        export = self._by_seq.get(seq.seq_id)
        if export is None:
            return
        self._start(export)
        ready = min(seq.num_computed_tokens, seq.num_prompt_tokens) // self.block_size
        if ready <= export.offered:
            return
        blocks = seq.block_table[export.offered:ready]
        self.pool.hold(blocks)
        for block in blocks:
            export.held[block.block_id] = block
        self.sender.offer(export.spec.transfer_id,
                          [(export.offered + k, b.block_id) for k, b in enumerate(blocks)])
        export.offered = ready

    def on_finish(self, seq: Sequence, reason: str) -> str | None:
        """Close (or abort) the sequence's transfer; returns the id of a transfer that ends here
        without ever having started (its request was aborted while queued)."""
        export = self._by_seq.pop(seq.seq_id, None)
        if export is None:
            return None
        if reason == "abort" and not export.started:  # nothing was reserved anywhere
            self._by_id.pop(export.spec.transfer_id, None)
            return export.spec.transfer_id
        self._start(export)
        if reason == "abort":
            self.sender.abort(export.spec.transfer_id, "the prefill request was aborted")
        else:
            self.sender.close(export.spec.transfer_id)
        return None

    def released(self, transfer_id: str, block_ids: list[int]) -> None:
        export = self._by_id.get(transfer_id)
        if export is None:
            return
        self.pool.release([b for i in block_ids if (b := export.held.pop(i, None)) is not None])

    def finished(self, transfer_id: str) -> None:
        """The transfer is over: drop every hold it still has."""
        export = self._by_id.pop(transfer_id, None)
        if export is None:
            return
        self._by_seq.pop(export.seq.seq_id, None)
        self.pool.release(list(reversed(export.held.values())))
        export.held.clear()
