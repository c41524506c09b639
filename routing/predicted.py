"""Predicted block entries: "this replica is about to hold these blocks", written at routing
time and expiring after a few seconds - long enough to cover the engine's event lag, so a burst
of siblings sent before the engine reports its blocks still lands together."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

MAX_SLOTS = 256  # the replica slot is packed into the low 8 bits of an entry's key


class PredictedBlocks:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.masks: dict[int, int] = {}  # block hash -> bitmask of replica slots
        self._expiry: dict[int, float] = {}  # (hash << 8 | slot) -> expiry time
        self._queue: deque[tuple[float, int, list[int]]] = deque()  # batches in expiry order
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._expiry)

    def add(self, slot: int, hashes: Sequence[int], expiry: float,
            skip: Callable[[int], bool]) -> None:
        """Predict `hashes` on `slot` until `expiry`, except those `skip` says are known."""
        bit = 1 << slot
        masks, expiries = self.masks, self._expiry
        fresh = []
        for h in hashes:
            if skip(h):
                continue
            masks[h] = masks.get(h, 0) | bit
            expiries[(h << 8) | slot] = expiry
            fresh.append(h)
        if fresh:
            self._queue.append((expiry, slot, fresh))
        while len(expiries) > self.max_entries and self._queue:
            self._drop_batch(force=True)

    def expire(self, now: float) -> None:
        queue = self._queue
        while queue and queue[0][0] <= now:
            self._drop_batch()

    def _drop_batch(self, force: bool = False) -> None:
        expiry, slot, hashes = self._queue.popleft()
        expiries = self._expiry
        for h in hashes:
            key = (h << 8) | slot
            current = expiries.get(key)
            if current is None or (current != expiry and not force):
                continue  # re-predicted later: a newer batch owns it
            del expiries[key]
            if force:
                self.evictions += 1
            self._clear_bit(h, slot)

    def discard(self, slot: int, hashes: Sequence[int]) -> None:
        """Withdraw predictions that turned out wrong (the blocks never arrived)."""
        for h in hashes:
            if self._expiry.pop((h << 8) | slot, None) is not None:
                self._clear_bit(h, slot)

    def drop_slot(self, slot: int) -> None:
        for key in [k for k in self._expiry if k & 0xFF == slot]:
            del self._expiry[key]
            self._clear_bit(key >> 8, slot)

    def _clear_bit(self, h: int, slot: int) -> None:
        m = self.masks.get(h, 0) & ~(1 << slot)
        if m:
            self.masks[h] = m
        else:
            self.masks.pop(h, None)
