"""The block pool: reference-counted KV blocks, the hash → block map of the prefix cache, the
queue of free blocks (cached ones stay hits until reused; see free_queue.py for the eviction
order), pinned blocks (never evicted while pinned), and the stored/removed event log.

With several KV cache groups (kv_cache_groups.py) each group caches its own blocks under the
same canonical hash; the stored/removed events, the snapshot and pins are group 0's (full
attention), so the router's view of a block is unchanged: the tokens are cached when their
full-attention KV is. Other groups' blocks come and go without events."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from backend_engine.free_queue import FreeBlockQueue
from backend_engine.kv_block import KVBlock


class NoFreeBlocksError(RuntimeError):
    """Raised when a caller asks for more blocks than are free (callers check first)."""


class PinnedCapacityError(RuntimeError):
    """Pinning these blocks would exceed the pool's pinned capacity."""


class BlockNotCachedError(KeyError):
    """A block hash to pin is not in the prefix cache."""


@dataclass(frozen=True, slots=True)
class BlockOrigin:
    """What a stored block holds, for publishers that describe blocks by their tokens (vLLM's
    BlockStored): its parent's hash (None for a first block), its tokens, its namespace."""

    parent: int | None
    token_ids: tuple[int, ...]
    namespace: str


@dataclass(slots=True)
class KVEvent:
    seq: int
    ts: float
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False
    origins: dict[int, BlockOrigin] | None = None  # of stored hashes, when the pool keeps them
    tier_stored: list[int] = field(default_factory=list)  # entered the KV tier below the pool
    tier_removed: list[int] = field(default_factory=list)  # left it

    def to_dict(self) -> dict:
        out = {"seq": self.seq, "ts": self.ts, "stored": self.stored, "removed": self.removed,
               "cleared": self.cleared}
        if self.tier_stored or self.tier_removed:
            out.update(tier_stored=self.tier_stored, tier_removed=self.tier_removed)
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, event_buffer: int = 4096,
                 eviction_policy: str = "slru", max_pinned_fraction: float = 0.25):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free = FreeBlockQueue(self.blocks, eviction_policy)
        self.max_pinned_blocks = int(num_blocks * max_pinned_fraction) if enable_caching else 0
        self.num_pinned_blocks = 0  # distinct blocks with pin_cnt > 0
        self.cached: dict[int, int] = {}  # block hash → block id (group 0)
        self.group_cached: dict[int, dict[int, int]] = {}  # group > 0 → its hash → block id
        self.event_seq = 0
        self.events: deque[KVEvent] = deque(maxlen=event_buffer)
        self._stored: list[int] = []
        self._removed: list[int] = []
        self._cleared = False
        self.keep_origins = False  # set by a ZMQ event publisher (server/kv_zmq_events.py)
        self._origins: dict[int, BlockOrigin] = {}
        self.tier = None  # a KVTier (backend_engine/kv_tier/) that keeps evicted blocks
        self._evicted: list[tuple] = []  # (hash, block id, origin) for the tier to copy
        self.children = None  # a BlockChildren (partial_block.py) while partial reuse is on

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def lookup(self, block_hash: int, group: int = 0) -> KVBlock | None:
        block_id = self._cache_of(group).get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def cached_hashes(self) -> list[int]:
        return list(self.cached)

    def tier_hashes(self) -> list[int]:
        """Blocks the KV tier below the pool holds (a block may be in both)."""
        return [] if self.tier is None else self.tier.hashes()

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self.free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            block = self.blocks[self.free.pop()]
            self._evict_hash(block)
            block.ref_cnt = 1
            out.append(block)
        if self._evicted:  # their data is intact until the next forward writes the blocks
            self.tier.offload(self._evicted)
            self._evicted = []
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on blocks found in the cache (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free.remove(block)
            block.ref_cnt += 1
            if block.block_hash is not None:
                block.hits += 1

    def hold(self, blocks: list[KVBlock]) -> None:
        """Take a reference without counting a prefix-cache hit (a KV transfer holding blocks
        while it reads or fills them)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free.remove(block)
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop a reference; pass a request's blocks tail first so its tail is evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free.push(block)

    def _cache_of(self, group: int) -> dict[int, int]:
        return self.cached if group == 0 else self.group_cached.setdefault(group, {})

    def cache_block(self, block: KVBlock, block_hash: int, origin: BlockOrigin | None = None,
                    group: int = 0) -> None:
        """Register a block that now holds a full block of verified tokens (of `group`)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        cache = self._cache_of(group)
        if block_hash in cache:  # another block already holds these tokens
            return
        block.block_hash = block_hash
        block.hits = 0
        block.group = group
        cache[block_hash] = block.block_id
        if group:
            return  # no events: the router follows group 0
        self._stored.append(block_hash)
        if origin is not None and origin.parent is not None and self.children is not None:
            self.children.add(origin.parent, block_hash, origin.token_ids)
        if origin is not None and self.keep_origins:
            self._origins[block_hash] = origin

    def _evict_hash(self, block: KVBlock) -> None:
        if block.group:
            cache = self.group_cached[block.group]
            if cache.get(block.block_hash) == block.block_id:
                del cache[block.block_hash]
            block.block_hash, block.hits, block.group = None, 0, 0
        elif block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
                self._removed.append(block.block_hash)
                if self.children is not None:
                    self.children.remove(block.block_hash)
                if self.tier is not None:
                    origin = self._origins.pop(block.block_hash, None) if self._origins else None
                    self._evicted.append((block.block_hash, block.block_id, origin))
            block.block_hash = None
            block.hits = 0

    # -- pins --------------------------------------------------------------------------------
    def pin(self, hashes: list[int]) -> list[KVBlock]:
        """Hold the cached blocks of these hashes until unpinned; all or nothing."""
        blocks = []
        for h in hashes:
            block = self.lookup(h)
            if block is None:
                raise BlockNotCachedError(h)
            blocks.append(block)
        new = len({b.block_id for b in blocks if b.pin_cnt == 0})
        if self.num_pinned_blocks + new > self.max_pinned_blocks:
            raise PinnedCapacityError(
                f"pinning {new} more blocks would exceed the pinned capacity "
                f"({self.num_pinned_blocks} of {self.max_pinned_blocks} blocks pinned)")
        self.touch(blocks)
        for block in blocks:
            block.pin_cnt += 1
            if block.pin_cnt == 1:
                self.num_pinned_blocks += 1
        return blocks

    def unpin(self, blocks: list[KVBlock]) -> None:
        """Release a pin's blocks, tail first; they stay cached like any freed block."""
        for block in blocks:
            block.pin_cnt -= 1
            if block.pin_cnt == 0:
                self.num_pinned_blocks -= 1
        self.release(list(reversed(blocks)))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is in use."""
        if len(self.free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.hits = 0
            block.group = 0
        self.free = FreeBlockQueue(self.blocks, self.free.policy, self.free.protected_cap)
        self.cached.clear()
        if self.children is not None:
            self.children.clear()
        self.group_cached.clear()
        self._origins.clear()
        self._stored.clear()
        self._removed.clear()
        self._cleared = True
        if self.tier is not None:
            self.tier.clear()
        return True

    # -- events --------------------------------------------------------------------------
    def flush_events(self) -> KVEvent | None:
        """Close the current step's changes into one numbered event (None if nothing changed)."""
        tier_stored, tier_removed = self.tier.take_events() if self.tier is not None else ([], [])
        if not (self._stored or self._removed or self._cleared or tier_stored or tier_removed):
            return None
        self.event_seq += 1
        # A hash stored and removed within one step is reported by its final state only.
        touched = dict.fromkeys(self._stored + self._removed)
        stored = [h for h in touched if h in self.cached]
        removed = [h for h in touched if h not in self.cached]
        origins = None
        if self._origins:
            origins = {h: self._origins[h] for h in stored if h in self._origins}
            if self.tier is None:  # with a tier they stay until eviction hands them to it
                self._origins = {}
        if tier_stored and self.tier.origins:
            kept = self.tier.origins
            origins = (origins or {}) | {h: kept[h] for h in tier_stored if h in kept}
        event = KVEvent(self.event_seq, time.time(), stored, removed, self._cleared, origins,
                        tier_stored, tier_removed)
        self._stored, self._removed, self._cleared = [], [], False
        self.events.append(event)
        return event

    def events_since(self, seq: int) -> list[KVEvent] | None:
        """Events with a larger seq; None when the replay buffer no longer reaches back."""
        events = list(self.events)  # one C-level copy: safe against the engine thread
        if not events or seq >= events[-1].seq:
            return []
        if events[0].seq > seq + 1:
            return None
        return [e for e in events if e.seq > seq]
