"""The queue of free KV blocks; its order is the eviction order.

Two policies:
- `lru`: one least-recently-freed order (vLLM's free-block queue).
- `slru`: scan-resistant, a segmented LRU. A cached block that was never hit since it was
  stored sits in the probation segment; one that served a prefix-cache hit sits in the
  protected segment, which is evicted only when probation is empty, so a flood of one-off
  prompts cannot push out reused prefixes. The protected segment is bounded: past its cap its
  least recent block is demoted to probation's most recent end (and must earn a new hit).

In both, blocks without a hash (nothing to lose) are reused first. Pinned blocks hold a
reference, so they never enter this queue.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from backend_engine.kv_block import KVBlock

log = logging.getLogger(__name__)

EVICTION_POLICIES = ("slru", "lru")
# Old names that configs written before a rename still use: old → current name.
DEPRECATED_EVICTION_POLICIES = {"kvgate": "slru"}


def eviction_policy_name(name: str) -> str:
    """The eviction policy `name` stands for; a deprecated alias logs a warning."""
    if name in DEPRECATED_EVICTION_POLICIES:
        new = DEPRECATED_EVICTION_POLICIES[name]
        log.warning("eviction policy %r is deprecated; it now is %r", name, new)
        name = new
    if name not in EVICTION_POLICIES:
        raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, not {name!r}")
    return name


class FreeBlockQueue:
    def __init__(self, blocks: list[KVBlock], policy: str = "slru",
                 protected_cap: int | None = None):
        self.policy = eviction_policy_name(policy)
        self.blocks = blocks
        self.protected_cap = len(blocks) // 2 if protected_cap is None else protected_cap
        self.empty: OrderedDict[int, None] = OrderedDict((b.block_id, None) for b in blocks)
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.empty) + len(self.probation) + len(self.protected)

    def push(self, block: KVBlock) -> None:
        """A block's last reference was dropped: it becomes the most recent of its segment."""
        if block.block_hash is None:
            self.empty[block.block_id] = None
            self.empty.move_to_end(block.block_id, last=False)
        elif self.policy == "slru" and block.hits > 0:
            self.protected[block.block_id] = None
            self._demote_overflow()
        else:
            self.probation[block.block_id] = None

    def remove(self, block: KVBlock) -> None:
        """A free cached block is reused by a hit (it leaves the queue, wherever it is)."""
        for segment in (self.probation, self.protected, self.empty):
            if segment.pop(block.block_id, 0) is None:
                return
        raise KeyError(block.block_id)

    def pop(self) -> int:
        """The block to hand out next: an empty one, else the least valuable cached one."""
        for segment in (self.empty, self.probation, self.protected):
            if segment:
                return segment.popitem(last=False)[0]
        raise IndexError("no free block")

    def _demote_overflow(self) -> None:
        while len(self.protected) > self.protected_cap:
            block_id, _ = self.protected.popitem(last=False)
            self.blocks[block_id].hits = 0
            self.probation[block_id] = None

    def eviction_order(self) -> list[int]:
        """Every free block id, the next to be reused first (for tests and inspection)."""
        return list(self.empty) + list(self.probation) + list(self.protected)
