"""Per-replica prefix index: which replica holds which canonical block hashes.

Three kinds of entries, one lookup:
  * exact      - from engine snapshots and KV events (`apply_snapshot`, `apply_event`);
  * approximate - for backends without events, learned from routing history, kept as an LRU
                  sized to the replica's capacity in blocks;
  * predicted  - written at routing time with a short TTL, so a burst of siblings routed before
                 the engine reports its blocks still lands together.

Resident (exact or approximate) entries live in one dict `hash -> bitmask of replica slots`, so a
prefix match walks the request's chain once, whatever the number of replicas.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from routing.hashing import DEFAULT_BLOCK_SIZE
from routing.predicted import MAX_SLOTS, PredictedBlocks
from routing.tier_index import TierIndex, clear_bit, set_bits

# Rough CPython cost of one resident entry: a slot in the shared dict (hash -> int mask) plus a
# slot in the replica's OrderedDict; used to turn a byte budget into an entry budget.
BYTES_PER_ENTRY = 200
BYTES_PER_PREDICTED_ENTRY = 260


class BlockSizeMismatch(ValueError):
    """The engine reports a block size the index was not built for: nothing would ever match."""


@dataclass(slots=True)
class ReplicaIndexState:
    slot: int
    approximate: bool = False
    capacity_blocks: int | None = None  # LRU size for approximate replicas
    synced: bool = False  # a snapshot has been applied since the last gap or restart
    seq: int = -1
    instance_id: str | None = None
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)  # oldest first


@dataclass(slots=True)
class IndexSize:
    resident_entries: int
    predicted_entries: int
    estimated_bytes: int
    evictions: int
    resyncs: int


class PrefixIndex:
    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_entries: int = 4_000_000,
        max_bytes: int | None = None,
        predicted_ttl_s: float = 3.0,
        max_predicted_entries: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size <= 0 or max_entries <= 0 or predicted_ttl_s < 0:
            raise ValueError("block_size and max_entries must be positive, predicted_ttl_s >= 0")
        self.block_size = block_size
        self.max_entries = max_entries
        if max_bytes is not None:
            self.max_entries = max(1, min(max_entries, max_bytes // BYTES_PER_ENTRY))
        self.predicted_ttl_s = predicted_ttl_s
        self.clock = clock
        self._replicas: dict[str, ReplicaIndexState] = {}
        self._names: dict[int, str] = {}
        self._resident: dict[int, int] = {}
        self._predicted = PredictedBlocks(max_predicted_entries)
        self.tier = TierIndex(self.max_entries)  # blocks in replicas' KV tiers below the pool
        self._num_resident = 0
        self._evictions = 0
        self._resyncs = 0

    # -- replicas -------------------------------------------------------------------------
    def add_replica(
        self, name: str, approximate: bool = False, capacity_blocks: int | None = None
    ) -> None:
        if name in self._replicas:
            return
        used = {r.slot for r in self._replicas.values()}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        if slot >= MAX_SLOTS:
            raise ValueError(f"an index holds at most {MAX_SLOTS} replicas")
        self._replicas[name] = ReplicaIndexState(slot, approximate, capacity_blocks)
        self._names[slot] = name

    def remove_replica(self, name: str) -> None:
        state = self._replicas.get(name)
        if state is None:
            return
        self.drop_replica(name)
        self._predicted.drop_slot(state.slot)
        del self._names[state.slot]
        del self._replicas[name]

    def replica(self, name: str) -> ReplicaIndexState:
        state = self._replicas.get(name)
        if state is None:
            raise KeyError(f"unknown replica {name!r}")
        return state

    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def drop_replica(self, name: str) -> None:
        """Forget every resident entry of a replica (restart, `cleared`, removal)."""
        state = self.replica(name)
        bit = 1 << state.slot
        resident = self._resident
        for h in state.blocks:
            clear_bit(resident, h, bit)
        self._num_resident -= len(state.blocks)
        state.blocks = OrderedDict()
        self.tier.drop(state.slot)

    # -- engine snapshots and events ------------------------------------------------------
    def apply_snapshot(self, name: str, snapshot: Mapping) -> None:
        """Replace a replica's entries with the engine's full set of cached blocks."""
        state = self.replica(name)
        bs = snapshot.get("block_size", self.block_size)
        if bs != self.block_size:
            raise BlockSizeMismatch(f"replica {name} uses block_size {bs}, index {self.block_size}")
        self.drop_replica(name)
        self._store(state, snapshot.get("blocks", ()))
        self.tier.store(state.slot, snapshot.get("tier_blocks", ()))
        state.seq = int(snapshot.get("seq", 0))
        state.instance_id = snapshot.get("instance_id", state.instance_id)
        state.synced = True

    def apply_event(self, name: str, event: Mapping) -> bool:
        """Apply one KV event; False means the caller must re-read the snapshot."""
        state = self.replica(name)
        seq = int(event["seq"])
        instance = event.get("instance_id")
        if instance is not None and state.instance_id is not None and instance != state.instance_id:
            return self._restart(state, name)
        if not state.synced:
            return False
        if seq <= state.seq:
            if seq == state.seq or instance is not None:
                return True  # a duplicate or an event the snapshot already covers
            return self._restart(state, name)  # seq went backwards: the replica restarted
        if seq != state.seq + 1:
            state.synced = False  # keep the stale entries until the snapshot replaces them
            self._resyncs += 1
            return False
        state.seq = seq
        if event.get("cleared"):
            self.drop_replica(name)
        removed = event.get("removed")
        if removed:
            self._remove(state, removed)
        stored = event.get("stored")
        if stored:
            self._store(state, stored)
        if "tier_stored" in event:
            self.tier.remove(state.slot, event.get("tier_removed") or ())
            self.tier.store(state.slot, event.get("tier_stored") or ())
        return True

    def apply_blocks(self, name: str, stored: Sequence[int] = (), removed: Sequence[int] = (),
                     tier_stored: Sequence[int] = (), tier_removed: Sequence[int] = ()) -> None:
        """Blocks of a replica fed by a foreign event stream (mapped in engine_blocks.py)."""
        state = self.replica(name)
        if removed:
            self._remove(state, removed)
        if stored:
            self._store(state, stored)
        self.tier.remove(state.slot, tier_removed)
        self.tier.store(state.slot, tier_stored)

    def set_approximate(self, name: str, approximate: bool,
                        capacity_blocks: int | None = None) -> None:
        """Switch a replica between exact entries and ones learned from routing history; its
        entries of the other kind are dropped."""
        state = self.replica(name)
        self.drop_replica(name)
        state.approximate = approximate
        state.capacity_blocks = capacity_blocks if approximate else None

    def _restart(self, state: ReplicaIndexState, name: str) -> bool:
        self.drop_replica(name)
        state.synced = False
        state.seq = -1
        state.instance_id = None
        self._resyncs += 1
        return False

    def _store(self, state: ReplicaIndexState, hashes: Sequence[int]) -> None:
        self._num_resident += set_bits(state.blocks, self._resident, hashes, 1 << state.slot)
        if state.capacity_blocks is not None:
            self._trim(state, state.capacity_blocks)
        if self._num_resident > self.max_entries:
            self._evict_global()

    def _remove(self, state: ReplicaIndexState, hashes: Sequence[int]) -> None:
        bit = 1 << state.slot
        resident = self._resident
        blocks = state.blocks
        for h in hashes:
            if blocks.pop(h, 0) is None:
                self._num_resident -= 1
                clear_bit(resident, h, bit)

    def _trim(self, state: ReplicaIndexState, keep: int) -> None:
        blocks = state.blocks
        excess = len(blocks) - keep
        if excess > 0:
            oldest = [h for h, _ in zip(blocks, range(excess))]
            self._remove(state, oldest)
            self._evictions += excess

    def _evict_global(self) -> None:
        # Take from the largest replica so one chatty replica cannot crowd out the others.
        while self._num_resident > self.max_entries:
            largest = max(self._replicas.values(), key=lambda r: len(r.blocks))
            over = self._num_resident - self.max_entries
            self._trim(largest, max(0, len(largest.blocks) - max(over, len(largest.blocks) // 64)))

    # -- routing-time writes --------------------------------------------------------------
    def record_route(self, name: str, hashes: Sequence[int]) -> None:
        """The request's blocks are about to live on `name`: predict them, and learn them for
        approximate replicas (whose only knowledge is routing history)."""
        state = self.replica(name)
        if state.approximate:
            self._store(state, hashes)
        if self.predicted_ttl_s > 0:
            self.predict(name, hashes)

    def predict(self, name: str, hashes: Sequence[int], ttl_s: float | None = None) -> None:
        """Mark blocks as about to live on `name` for `ttl_s` (default: the index's TTL).
        Blocks the replica already holds are skipped: their entry is exact already."""
        state = self.replica(name)
        bit = 1 << state.slot
        resident = self._resident.get
        expiry = self.clock() + (self.predicted_ttl_s if ttl_s is None else ttl_s)
        self._predicted.add(state.slot, hashes, expiry, lambda h: bool(resident(h, 0) & bit))

    def unpredict(self, name: str, hashes: Sequence[int]) -> None:
        """Withdraw `name`'s predicted entries for these blocks (a transfer to it failed)."""
        self._predicted.discard(self.replica(name).slot, hashes)

    def expire_predicted(self) -> None:
        self._predicted.expire(self.clock())

    # -- lookup ---------------------------------------------------------------------------
    def match(self, hashes: Sequence[int], include_predicted: bool = True) -> dict[str, int]:
        """Longest consecutive prefix, in blocks, that each replica holds."""
        if include_predicted:
            self.expire_predicted()
        resident = self._resident.get
        masks = self._predicted.masks
        predicted = masks.get if include_predicted and masks else None
        alive = 0
        for state in self._replicas.values():
            alive |= 1 << state.slot
        result = dict.fromkeys(self._replicas, 0)
        depth = 0
        for h in hashes:
            m = resident(h, 0)
            if predicted is not None:
                m |= predicted(h, 0)
            m &= alive
            if m != alive:
                self._assign(result, alive & ~m, depth)
                alive = m
                if not alive:
                    return result
            depth += 1
        self._assign(result, alive, depth)
        return result

    def match_tier(self, hashes: Sequence[int], depths: Mapping[str, int]) -> dict[str, int]:
        """Blocks past each replica's pool match (`depths`, from `match`) that its KV tier
        holds, in a consecutive run; replicas without tier blocks are absent."""
        if not len(self.tier):
            return {}
        slots = {name: state.slot for name, state in self._replicas.items()}
        return self.tier.extend(hashes, depths, slots, self._resident.get)

    def _assign(self, result: dict[str, int], mask: int, depth: int) -> None:
        names = self._names
        while mask:
            low = mask & -mask
            result[names[low.bit_length() - 1]] = depth
            mask ^= low

    def size(self) -> IndexSize:
        predicted = len(self._predicted)
        return IndexSize(
            resident_entries=self._num_resident + len(self.tier),
            predicted_entries=predicted,
            estimated_bytes=(self._num_resident + len(self.tier)) * BYTES_PER_ENTRY
            + predicted * BYTES_PER_PREDICTED_ENTRY,
            evictions=self._evictions + self._predicted.evictions + self.tier.evictions,
            resyncs=self._resyncs,
        )
