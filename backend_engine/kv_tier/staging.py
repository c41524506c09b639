"""Disk reads that requests wait for (vLLM's asynchronous KV load): a request whose prefix is on
the disk level starts a read on the disk store's reader thread and waits, holding no pool block,
while other requests step; once the read is done its blocks are restored from memory like RAM
blocks. Bounded: at most `max_blocks` blocks are being read or held read at once."""

from __future__ import annotations

from backend_engine.kv_tier.disk_store import DiskRead, DiskStore

NOT_STAGED = object()


class Staging:
    def __init__(self, disk: DiskStore, max_blocks: int):
        self.disk = disk
        self.max_blocks = max_blocks
        self.reads: dict[str, DiskRead] = {}  # owner (a sequence id) → its read
        self.by_hash: dict[int, DiskRead] = {}  # block hash → the read that brings it
        self.num_blocks = 0

    def room(self) -> int:
        return max(0, self.max_blocks - self.num_blocks)

    def start(self, owner: str, hashes: list[int]) -> None:
        read = self.disk.read(hashes)
        self.reads[owner] = read
        self.num_blocks += len(hashes)
        for h in hashes:
            self.by_hash[h] = read

    def ready(self, block_hash: int) -> bool:
        read = self.by_hash.get(block_hash)
        return read is not None and read.done.is_set()

    def pending(self, hashes: list[int]) -> bool:
        """Whether a read of any of these blocks is still under way."""
        return any(not read.done.is_set()
                   for read in (self.by_hash.get(h) for h in hashes) if read is not None)

    def wait(self, timeout_s: float) -> None:
        """Block briefly until a read under way is done (the engine has nothing else to run)."""
        read = next((r for r in self.reads.values() if not r.done.is_set()), None)
        if read is not None:
            read.done.wait(timeout_s)

    def take(self, block_hash: int) -> object:
        """The block's bytes (None: the read failed), waiting for its read; NOT_STAGED if no
        read brings it."""
        read = self.by_hash.get(block_hash)
        if read is None:
            return NOT_STAGED
        read.done.wait()
        return read.payloads.get(block_hash)

    def release(self, owner: str) -> float:
        """Forget the owner's read (cancelling what is left of it); its reading seconds."""
        read = self.reads.pop(owner, None)
        if read is None:
            return 0.0
        read.cancelled = True
        self.num_blocks -= len(read.hashes)
        for h in read.hashes:
            if self.by_hash.get(h) is read:
                del self.by_hash[h]
        return read.seconds if read.done.is_set() else 0.0

    def clear(self) -> None:
        for owner in list(self.reads):
            self.release(owner)
