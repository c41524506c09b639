"""The disk level of the KV tier: one file per block under `<dir>/<layout fingerprint>/`, written
by one background thread, bounded in bytes with its own LRU, checked on every load.

A file is a fixed header then the block's bytes (the pool's dtype, the layout of
`kv_transfer/block_io.py`):

    magic b"KVT1" | block hash u64 | payload bytes u64 | xxh3-64 of the payload u64

A file is written to a temporary name and renamed, so a crash leaves no half-written block under
a block's name. At start-up the directory is scanned (header and size: a truncated or foreign
file is dropped and counted); every read verifies the checksum before the bytes are served (a
corrupt file is dropped and counted, and the caller recomputes). Blocks of another model or
layout live in another fingerprint's folder and are left alone.

The engine thread owns the index (which hashes are on disk, in LRU order); the writer thread
only writes and deletes files, in the order it was asked to. Reads never run on the engine
thread either: `read` queues them for a reader thread, which reads and checks the files and
marks the read done (vLLM's asynchronous KV load); blocks queued but not yet written are read
from memory."""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

log = logging.getLogger("kvgate.kv_tier")

MAGIC = b"KVT1"
HEADER = struct.Struct("<4sQQQ")
SUFFIX = ".kvb"


def block_path(folder: Path, block_hash: int) -> Path:
    return folder / f"{block_hash:016x}{SUFFIX}"


def encode(block_hash: int, payload: bytes | memoryview) -> bytes:
    return HEADER.pack(MAGIC, block_hash, len(payload), xxhash.xxh3_64_intdigest(payload))


@dataclass(slots=True)
class DiskRead:
    """Blocks the reader thread reads, in order; `payloads` holds each one's verified bytes (None:
    missing or corrupt) once `done` is set."""

    hashes: list[int]
    payloads: dict[int, bytes | memoryview | None] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    seconds: float = 0.0


class DiskStore:
    def __init__(self, root: str | os.PathLike, fingerprint: str, block_bytes: int,
                 capacity_bytes: int, max_backlog: int = 256):
        self.folder = Path(root) / fingerprint
        self.folder.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        self.file_bytes = HEADER.size + block_bytes
        self.capacity_blocks = max(0, capacity_bytes // self.file_bytes)
        self.max_backlog = max_backlog
        self.index: OrderedDict[int, None] = OrderedDict()  # on disk or queued, oldest first
        self.corrupt_files = 0  # dropped: truncated, foreign or failing their checksum
        self.write_failures = 0
        self.dropped_writes = 0  # not queued: the backlog was full
        self._pending: dict[int, tuple[int, bytes | memoryview]] = {}  # queued: (job, bytes)
        self._next_job = 0
        self._failed: list[int] = []  # writes that failed, for the engine thread to forget
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._reads: queue.SimpleQueue = queue.SimpleQueue()
        self._scan()
        self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
        self._thread.start()
        self._reader = threading.Thread(target=self._read_loop, name="kv-tier-reader",
                                        daemon=True)
        self._reader.start()

    # -- engine thread -----------------------------------------------------------------------
    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.index

    @property
    def backlog(self) -> int:
        return len(self._pending)

    @property
    def used_bytes(self) -> int:
        return len(self.index) * self.file_bytes

    def put(self, block_hash: int, payload: bytes | memoryview) -> list[int] | None:
        """Queue a block's write; returns the hashes dropped to make room (None: not queued)."""
        if self.capacity_blocks == 0 or len(self._pending) >= self.max_backlog:
            self.dropped_writes += 1
            return None
        self._next_job += 1
        with self._lock:
            self._pending[block_hash] = (self._next_job, payload)
        self.index[block_hash] = None
        self._jobs.put(("write", (block_hash, self._next_job)))
        dropped = []
        while len(self.index) > self.capacity_blocks:
            old, _ = self.index.popitem(last=False)
            self._jobs.put(("delete", old))
            dropped.append(old)
        return dropped

    def touch(self, block_hash: int) -> None:
        self.index.move_to_end(block_hash)

    def read(self, hashes: list[int]) -> DiskRead:
        """Queue the blocks' reads for the reader thread."""
        job = DiskRead(list(hashes))
        self._reads.put(job)
        return job

    def drop_corrupt(self, block_hash: int) -> None:
        """A read found the block's file missing or failing its check: forget it, count it."""
        self.corrupt_files += 1
        self.remove(block_hash)
        log.warning("KV tier file for block %016x failed its check; dropped", block_hash)

    def remove(self, block_hash: int) -> None:
        if self.index.pop(block_hash, 0) is None:
            self._jobs.put(("delete", block_hash))

    def reap_failed(self) -> list[int]:
        """Hashes whose write failed since the last call (dropped from the index)."""
        if not self._failed:
            return []
        with self._lock:
            failed, self._failed = self._failed, []
        for h in failed:
            self.index.pop(h, None)
        return failed

    def clear(self) -> list[int]:
        hashes = list(self.index)
        for h in hashes:
            self.remove(h)
        return hashes

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued job is done (tests, shutdown)."""
        done = threading.Event()
        self._jobs.put(("flush", done))
        done.wait(timeout_s)

    def close(self) -> None:
        self.flush()
        self._jobs.put(("stop", None))
        self._reads.put(None)
        self._thread.join(timeout=5)
        self._reader.join(timeout=5)

    # -- start-up ----------------------------------------------------------------------------
    def _scan(self) -> None:
        found = []
        for path in self.folder.iterdir():
            if path.suffix != SUFFIX:
                if path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)  # a write cut short by a crash
                continue
            try:
                stat = path.stat()
                with path.open("rb") as f:
                    header = f.read(HEADER.size)
                block_hash = self._header_hash(header, stat.st_size)
            except OSError:
                block_hash = None
            if block_hash is None or path.name != block_path(self.folder, block_hash).name:
                self.corrupt_files += 1
                path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime_ns, block_hash))
        for _, block_hash in sorted(found):  # oldest first: the LRU order survives a restart
            self.index[block_hash] = None
        while len(self.index) > self.capacity_blocks:
            self.remove(next(iter(self.index)))
        if found:
            log.info("KV tier: %d blocks on disk in %s", len(self.index), self.folder)

    def _header_hash(self, header: bytes, size: int) -> int | None:
        if len(header) != HEADER.size or size != self.file_bytes:
            return None
        magic, block_hash, length, _ = HEADER.unpack(header)
        return block_hash if magic == MAGIC and length == self.block_bytes else None

    def _verified(self, block_hash: int, data: bytes) -> memoryview | None:
        if self._header_hash(data[:HEADER.size], len(data)) != block_hash:
            return None
        payload = memoryview(data)[HEADER.size:]
        checksum = HEADER.unpack(data[:HEADER.size])[3]
        return payload if xxhash.xxh3_64_intdigest(payload) == checksum else None

    # -- the reader thread -------------------------------------------------------------------
    def _read_loop(self) -> None:
        while (job := self._reads.get()) is not None:
            started = time.perf_counter()
            for h in job.hashes:
                if job.cancelled:
                    break
                try:
                    job.payloads[h] = self._load(h)
                except Exception:  # never leave a request waiting: the block is recomputed
                    log.exception("KV tier: reading block %016x failed", h)
                    job.payloads[h] = None
            job.seconds = time.perf_counter() - started
            job.done.set()

    def _load(self, block_hash: int) -> bytes | memoryview | None:
        """The block's verified bytes (from memory while its write is queued), else None."""
        with self._lock:
            pending = self._pending.get(block_hash)
        if pending is not None:
            return pending[1]
        try:
            data = block_path(self.folder, block_hash).read_bytes()
        except OSError:
            return None
        return self._verified(block_hash, data)

    # -- the writer thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job, arg = self._jobs.get()
            if job == "stop":
                return
            if job == "flush":
                arg.set()
            elif job == "delete":
                block_path(self.folder, arg).unlink(missing_ok=True)
            else:
                self._write(arg)

    def _write(self, job: tuple[int, int]) -> None:
        block_hash, number = job
        with self._lock:
            pending = self._pending.get(block_hash)
        if pending is None or pending[0] != number:
            return  # the block was queued again since: that later job writes it
        payload = pending[1]
        path = block_path(self.folder, block_hash)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with tmp.open("wb") as f:
                f.write(encode(block_hash, payload))
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            log.exception("KV tier: writing block %016x failed", block_hash)
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.write_failures += 1
                self._failed.append(block_hash)
        with self._lock:
            if self._pending.get(block_hash, (None,))[0] == number:
                del self._pending[block_hash]
