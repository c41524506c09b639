"""The KV tier below the block pool: cached blocks the pool evicts are copied here (host RAM,
and/or a disk folder), keyed by their canonical block hash, and copied back into the pool when
a prefix lookup misses the pool and finds them here, so the request skips their prefill.

Everything here runs on the engine thread except the disk writes and reads (disk_store.py). The
copy at eviction is one gather of the evicted blocks out of the KV tensors; RAM keeps that copy,
the disk level queues it for its writer thread. A block on the disk level is read by the
reader thread while its request waits (staging.py), then restored from memory.
Blocks are stored exactly, in the pool's dtype, so a restored prefix gives the tokens a
recompute gives. The hash already carries the namespace (model, tenant salt), so a tier never
serves another tenant's block.

Both levels are bounded in bytes with their own LRU. A block is "in the tier" while either
level holds it; its entering and leaving are reported with the pool's KV events.

With tensor parallelism every rank keeps a KVTier of its own heads' shard of each block, under
the same block hashes (its disk level in a folder of its own). The engine drives rank 0's tier;
each change is mirrored to the other ranks' tiers in the same order (`peers`, peers.py), so
their LRUs agree, and a restore counts only the leading blocks every rank restored."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import xxhash

from backend_engine.block_pool import BlockOrigin
from backend_engine.kv_tier.disk_store import DiskStore
from backend_engine.kv_tier.staging import NOT_STAGED, Staging
from backend_engine.kv_transfer.block_io import BlockIO


@dataclass(slots=True)
class TierStats:
    hits: int = 0  # tokens restored into the pool
    misses: int = 0  # tokens a request's first lookup found in neither the pool nor the tier
    hits_by_level: dict[str, int] = field(default_factory=lambda: {"ram": 0, "disk": 0})
    offloaded_blocks: int = 0  # blocks copied in at eviction
    restored_blocks: int = 0
    restore_seconds: float = 0.0  # total, for the measured cost per token
    read_seconds: float = 0.0  # disk reads, on the reader thread


class TierPeers:
    """The same tier on the other tensor-parallel ranks: none in one process."""

    def mirror(self, op: str, *args) -> None:
        """Apply this change to the other ranks' tiers too."""

    def agree(self, call: tuple, restored: Callable[[], int]) -> int:
        """Run the restore `call` on every rank; the leading blocks all of them restored."""
        return restored()


class KVTier:
    def __init__(self, io: BlockIO, ram_bytes: int, disk_dir: str | None = None,
                 disk_bytes: int = 0, max_backlog: int = 256, max_reads: int = 256,
                 peers: TierPeers | None = None):
        self.io = io
        self.block_size = io.layout.block_size
        self.block_bytes = io.layout.block_bytes
        self.ram_capacity = max(0, ram_bytes // self.block_bytes)
        self.ram: OrderedDict[int, torch.Tensor] = OrderedDict()  # oldest first
        self.disk = None
        if disk_dir:
            fingerprint = f"{xxhash.xxh3_64_intdigest(repr(io.layout).encode()):016x}"
            self.disk = DiskStore(disk_dir, fingerprint, self.block_bytes, disk_bytes,
                                  max_backlog)
        self.staging = Staging(self.disk, max_reads) if self.disk is not None else None
        self.peers = peers or TierPeers()
        self.stats = TierStats()
        self.observe: Callable[[float], None] = lambda seconds: None  # each restore's duration
        self._stored: list[int] = []
        self._removed: list[int] = []
        self.origins: dict[int, BlockOrigin] = {}  # for publishers of vLLM's events

    # -- queries -----------------------------------------------------------------------------
    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.ram or (self.disk is not None and block_hash in self.disk)

    def hashes(self) -> list[int]:
        if self.disk is None:
            return list(self.ram)
        return list(dict.fromkeys([*self.ram, *self.disk.index]))

    # -- eviction from the pool --------------------------------------------------------------
    def offload(self, evicted: list[tuple]) -> None:
        """Copy blocks the pool is about to reuse: (block hash, block id, origin or None)."""
        self.peers.mirror("offload", [(h, block_id, None) for h, block_id, _ in evicted])
        self._reap()
        new = []
        for h, block_id, origin in evicted:
            if h in self:  # already kept: it only becomes the most recent
                self._touch(h)
            else:
                new.append((h, block_id, origin))
        if not new:
            return
        data = self.io.read([block_id for _, block_id, _ in new])
        for i, (h, _, origin) in enumerate(new):
            block = data[i] if len(new) == 1 else data[i].clone()  # own storage: freed alone
            self._keep(h, block, origin)

    def _keep(self, h: int, block: torch.Tensor, origin: BlockOrigin | None) -> None:
        kept = False
        if self.ram_capacity:
            self.ram[h] = block
            kept = True
            while len(self.ram) > self.ram_capacity:
                old, _ = self.ram.popitem(last=False)
                self._left_level(old)
        if self.disk is not None:
            dropped = self.disk.put(h, BlockIO.frames(block.unsqueeze(0))[0])
            if dropped is not None:
                kept = True
                for old in dropped:
                    self._left_level(old)
        if kept:
            self.stats.offloaded_blocks += 1
            self._stored.append(h)
            if origin is not None:
                self.origins[h] = origin

    def touch(self, hashes: list[int]) -> None:
        """Make these blocks the most recently used (a restore of them is about to follow)."""
        self.peers.mirror("touch", hashes)
        for h in hashes:
            self._touch(h)

    def _touch(self, h: int) -> None:
        if h in self.ram:
            self.ram.move_to_end(h)
        if self.disk is not None and h in self.disk:
            self.disk.touch(h)

    def _left_level(self, h: int) -> None:
        if h not in self:
            self._removed.append(h)
            self.origins.pop(h, None)

    def _reap(self) -> None:
        if self.disk is not None:
            for h in self.disk.reap_failed():
                self._left_level(h)

    # -- disk reads a request waits for ------------------------------------------------------
    def wait_for_disk(self, owner: str, hashes: list[int]) -> bool:
        """Whether `owner` must wait for disk reads before restoring the leading blocks of
        `hashes` the tier holds; starts the reads it needs (engine side, rank 0)."""
        if self.staging is None:
            return False
        run = []
        for h in hashes:
            if h not in self:
                break
            if h not in self.ram:
                run.append(h)
        missing = [h for h in run if h not in self.staging.by_hash]
        room = self.staging.room()
        if missing and room and owner not in self.staging.reads:
            self.prefetch(owner, missing[:room])
        return self.staging.pending(run)

    def prefetch(self, owner: str, hashes: list[int]) -> None:
        """Start reading these disk blocks for `owner` on the reader thread."""
        self.peers.mirror("prefetch", owner, hashes)
        if self.staging is not None and owner not in self.staging.reads:
            self.staging.start(owner, hashes)

    def release(self, owner: str) -> None:
        """Drop what `owner`'s disk read brought (restored, or no longer wanted)."""
        if self.staging is not None and owner in self.staging.reads:
            self.peers.mirror("release", owner)
            self.stats.read_seconds += self.staging.release(owner)

    def wait_for_reads(self, timeout_s: float) -> None:
        if self.staging is not None:
            self.staging.wait(timeout_s)

    def servable(self, h: int) -> bool:
        """Whether a restore can copy the block now, without touching the disk."""
        return h in self.ram or (self.staging is not None and self.staging.ready(h))

    # -- restore into the pool ---------------------------------------------------------------
    def load(self, hashes: list[int]) -> tuple[list[torch.Tensor], list[str]]:
        """The blocks' data and level, in order, stopping at the first one no level can serve
        intact (a disk block only once its read is staged)."""
        out, levels = [], []
        for h in hashes:
            block = self.ram.get(h)
            if block is not None:
                self.ram.move_to_end(h)
                levels.append("ram")
            else:
                payload = NOT_STAGED if self.staging is None else self.staging.take(h)
                if payload is NOT_STAGED:
                    break
                if payload is None:  # corrupt or gone: dropped, the rest is recomputed
                    if h in self.disk:
                        self.disk.drop_corrupt(h)
                    self._left_level(h)
                    break
                if h in self.disk:
                    self.disk.touch(h)
                block = self.io.from_frames([payload])[0]
                levels.append("disk")
            out.append(block)
        return out, levels

    def restore(self, hashes: list[int], block_ids: list[int]) -> int:
        """Write the tier's copies of `hashes` into the pool blocks `block_ids`; returns how
        many leading blocks were restored (on every rank)."""
        started = time.perf_counter()
        levels: list[str] = []

        def restore_here() -> int:
            blocks, found = self.load(hashes)
            if blocks:
                self.io.write(block_ids[:len(blocks)], torch.stack(blocks))
            levels.extend(found)
            return len(blocks)

        n = self.peers.agree(("restore", hashes, block_ids), restore_here)
        seconds = time.perf_counter() - started
        self.stats.restored_blocks += n
        for level in levels[:n]:
            self.stats.hits_by_level[level] += 1
        if n:
            self.stats.restore_seconds += seconds
            self.observe(seconds)
        return n

    def restore_seconds_per_token(self) -> float | None:
        """Copying back and, for disk blocks, reading them (off the engine thread, but the
        request waits for it)."""
        tokens = self.stats.restored_blocks * self.block_size
        seconds = self.stats.restore_seconds + self.stats.read_seconds
        return seconds / tokens if tokens else None

    # -- events and upkeep -------------------------------------------------------------------
    def take_events(self) -> tuple[list[int], list[int]]:
        """Hashes that entered and left the tier since the last call, final state per hash."""
        self._reap()
        if not (self._stored or self._removed):
            return [], []
        entered = set(self._stored)  # not in the tier when the window opened
        touched = dict.fromkeys(self._stored + self._removed)
        self._stored, self._removed = [], []
        return ([h for h in touched if h in self],
                [h for h in touched if h not in self and h not in entered])

    def clear(self) -> None:
        self.peers.mirror("clear")
        if self.staging is not None:
            self.staging.clear()
        self.origins.clear()
        self._removed.extend(self.ram)
        self.ram.clear()
        if self.disk is not None:
            self._removed.extend(self.disk.clear())

    def info(self) -> dict:
        out = {"ram_blocks": len(self.ram),
               "ram_bytes": len(self.ram) * self.block_bytes,
               "ram_capacity_bytes": self.ram_capacity * self.block_bytes,
               "hit_tokens": self.stats.hits, "miss_tokens": self.stats.misses,
               "hit_tokens_by_level": {k: v * self.block_size
                                       for k, v in self.stats.hits_by_level.items()},
               "offloaded_blocks": self.stats.offloaded_blocks,
               "restored_blocks": self.stats.restored_blocks,
               "restore_seconds_total": round(self.stats.restore_seconds, 6)}
        if self.staging is not None:
            out.update(read_blocks=self.staging.num_blocks,
                       read_seconds_total=round(self.stats.read_seconds, 6))
        if self.disk is not None:
            out.update(disk_blocks=len(self.disk.index), disk_bytes=self.disk.used_bytes,
                       disk_capacity_bytes=self.disk.capacity_blocks * self.disk.file_bytes,
                       write_backlog=self.disk.backlog, corrupt_files=self.disk.corrupt_files,
                       write_failures=self.disk.write_failures,
                       dropped_writes=self.disk.dropped_writes)
        return out

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
