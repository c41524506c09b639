"""Blocks a replica keeps in the KV tier below its block pool (host memory, disk), from its
snapshot's `tier_blocks` and its events' `tier_stored` / `tier_removed`.

A tier block is not a pool hit: the engine copies it back before it can skip the prefill, so
the policy prices it between a hit and a miss (`prefix_cost.py`). A prefix is matched through
the pool first; the tier extends each replica's match past its pool depth, block by block,
through blocks held by either level."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence


def clear_bit(masks: dict[int, int], h: int, bit: int) -> None:
    """Take one replica's bit off a hash's mask of replica slots (the entry goes at zero)."""
    m = masks.get(h, 0) & ~bit
    if m:
        masks[h] = m
    else:
        masks.pop(h, None)


def set_bits(blocks: OrderedDict[int, None], masks: dict[int, int], hashes: Sequence[int],
             bit: int) -> int:
    """Record `hashes` as held by one replica slot: its LRU (`blocks`, oldest first; a hash
    already there becomes the most recent) and each hash's mask of slots. Returns how many
    hashes were new to the slot."""
    added = 0
    for h in hashes:
        if h in blocks:
            blocks.move_to_end(h)
            continue
        blocks[h] = None
        masks[h] = masks.get(h, 0) | bit
        added += 1
    return added


class TierIndex:
    def __init__(self, max_entries: int = 4_000_000) -> None:
        self.max_entries = max_entries
        self._masks: dict[int, int] = {}  # hash -> bitmask of replica slots
        self._blocks: dict[int, OrderedDict[int, None]] = {}  # slot -> hashes, oldest first
        self._num = 0
        self.evictions = 0

    def __len__(self) -> int:
        return self._num

    def count(self, slot: int) -> int:
        """Tier blocks the index holds for one replica slot."""
        return len(self._blocks.get(slot, ()))

    def store(self, slot: int, hashes: Sequence[int]) -> None:
        blocks = self._blocks.setdefault(slot, OrderedDict())
        self._num += set_bits(blocks, self._masks, hashes, 1 << slot)
        while self._num > self.max_entries:  # from the largest replica, oldest first
            largest = max(self._blocks, key=lambda s: len(self._blocks[s]))
            self.remove(largest, [next(iter(self._blocks[largest]))])
            self.evictions += 1

    def remove(self, slot: int, hashes: Sequence[int]) -> None:
        blocks = self._blocks.get(slot)
        if not blocks:
            return
        bit = 1 << slot
        masks = self._masks
        for h in hashes:
            if blocks.pop(h, 0) is None:
                self._num -= 1
                clear_bit(masks, h, bit)

    def drop(self, slot: int) -> None:
        blocks = self._blocks.get(slot)
        if blocks:
            self.remove(slot, list(blocks))

    def extend(self, hashes: Sequence[int], depths: Mapping[str, int],
               slots: Mapping[str, int], resident: Callable[[int, int], int]) -> dict[str, int]:
        """Per replica holding tier blocks: how many blocks past its pool depth the prefix
        continues through blocks its tier (or its pool) holds."""
        out: dict[str, int] = {}
        masks = self._masks
        for name, slot in slots.items():
            if not self._blocks.get(slot):
                continue
            bit = 1 << slot
            start = i = depths.get(name, 0)
            while i < len(hashes) and (masks.get(hashes[i], 0) | resident(hashes[i], 0)) & bit:
                i += 1
            if i > start:
                out[name] = i - start
        return out
