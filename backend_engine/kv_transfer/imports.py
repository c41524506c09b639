"""The decode side's block bookkeeping (engine thread only).

A transfer's opening holds the blocks this replica already caches and reserves free blocks for
the rest, up to what the pool can spare; its end registers the received blocks as cached - so
they serve any later request and appear in KV events - and keeps them held until the request
that follows claims them (or `claim_ttl_s` passes). A failed transfer frees every reservation
and registers nothing. Reserved blocks carry no hash, so nothing else reads or writes them
while the transport fills them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from backend_engine.block_pool import BlockPool
from backend_engine.kv_block import KVBlock
from backend_engine.kv_transfer.base import Reservation


@dataclass(slots=True)
class _Import:
    hashes: list[int]
    held: dict[int, KVBlock]  # block index → a block this replica had cached already
    reserved: dict[int, KVBlock]  # block index → the block that will receive it


@dataclass(slots=True)
class _Claim:
    blocks: list[KVBlock]  # in prompt order
    expires_at: float


class KVImports:
    def __init__(self, pool: BlockPool, claim_ttl_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.pool = pool
        self.claim_ttl_s = claim_ttl_s
        self.clock = clock
        # never reserve the last blocks: running sequences need them to keep decoding
        self.headroom = max(1, pool.num_blocks // 16)
        self._imports: dict[str, _Import] = {}
        self._claims: dict[str, _Claim] = {}  # insertion order is expiry order
        self.blocks_imported = 0

    @property
    def in_flight(self) -> int:
        return len(self._imports)

    @property
    def held_blocks(self) -> int:
        """Blocks held by transfers in flight and by claims not yet taken."""
        return (sum(len(i.held) + len(i.reserved) for i in self._imports.values())
                + sum(len(c.blocks) for c in self._claims.values()))

    def reserve(self, transfer_id: str, hashes: list[int]) -> Reservation:
        if transfer_id in self._imports or transfer_id in self._claims:
            return Reservation(error=f"transfer {transfer_id!r} exists already")
        cached = {i: b for i, h in enumerate(hashes) if (b := self.pool.lookup(h)) is not None}
        budget = self.pool.num_free_blocks - self.headroom
        limit, cost = len(hashes), 0
        for i in range(len(hashes)):  # a prefix only: blocks past a gap could never hit
            block = cached.get(i)
            step = 1 if block is None or block.ref_cnt == 0 else 0  # it leaves the free queue
            if cost + step > budget:
                limit = i
                break
            cost += step
        held = {i: b for i, b in cached.items() if i < limit}
        self.pool.hold(list(held.values()))
        need = [i for i in range(limit) if i not in cached]
        reserved = dict(zip(need, self.pool.allocate(len(need))))
        self._imports[transfer_id] = _Import(list(hashes), held, reserved)
        return Reservation(need, [reserved[i].block_id for i in need])

    def complete(self, transfer_id: str, received: list[int]) -> int:
        """Register what arrived (verified) as cached and hold it for the claim; unfilled
        reservations go back. Returns the number of blocks that entered the cache."""
        entry = self._imports.pop(transfer_id, None)
        if entry is None:
            return 0
        got = set(received)
        claimed = dict(entry.held)
        imported = 0
        for i, block in sorted(entry.reserved.items()):
            if i not in got:
                self.pool.release([block])
                continue
            existing = self.pool.lookup(entry.hashes[i])
            if existing is None:
                self.pool.cache_block(block, entry.hashes[i])
                claimed[i] = block
                imported += 1
            else:  # a concurrent transfer brought the same tokens first: keep that copy
                self.pool.hold([existing])
                self.pool.release([block])
                claimed[i] = existing
        self.blocks_imported += imported
        blocks = [claimed[i] for i in sorted(claimed)]
        self._claims[transfer_id] = _Claim(blocks, self.clock() + self.claim_ttl_s)
        return imported

    def fail(self, transfer_id: str) -> None:
        entry = self._imports.pop(transfer_id, None)
        if entry is None:
            return
        self.release([*(entry.held[i] for i in sorted(entry.held)),
                      *(entry.reserved[i] for i in sorted(entry.reserved))])

    def in_flight_id(self, transfer_id: str) -> bool:
        """Still open: its completion (or failure) has not been applied yet."""
        return transfer_id in self._imports

    def claim(self, transfer_id: str) -> list[KVBlock] | None:
        """The request that follows a transfer takes over its holds (released at its end)."""
        entry = self._claims.pop(transfer_id, None)
        return None if entry is None else entry.blocks

    def release(self, blocks: list[KVBlock]) -> None:
        self.pool.release(list(reversed(blocks)))  # tail first: it is evicted first

    def expire(self) -> int:
        """Drop claims nobody took in time (the request went elsewhere or never came)."""
        now, expired = self.clock(), []
        for transfer_id, entry in self._claims.items():
            if entry.expires_at > now:
                break
            expired.append(transfer_id)
        for transfer_id in expired:
            self.release(self._claims.pop(transfer_id).blocks)
        return len(expired)

    def clear(self) -> None:
        for transfer_id in list(self._imports):
            self.fail(transfer_id)
        for entry in self._claims.values():
            self.release(entry.blocks)
        self._claims.clear()
