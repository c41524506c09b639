"""The KV tier under tensor parallelism: one KVTier per rank over its own shard of the KV cache.

The engine drives rank 0's tier exactly as in one process. Each change it makes (offload,
touch, restore, prefetch, release, clear) is sent to the workers as a `TierCall` on the step
channel, in order, before the step that could overwrite the blocks, and each worker applies it
to its own tier. A restore ends with a minimum over the ranks of the leading blocks each one
restored (a rank whose file was corrupt restores fewer), so every rank agrees what the pool
holds and the rest is recomputed. Events and metrics come from rank 0 only."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from backend_engine.config import EngineConfig
from backend_engine.kv_tier.tier import KVTier, TierPeers
from backend_engine.kv_transfer.block_io import BlockIO


@dataclass(frozen=True, slots=True)
class TierCall:
    """A change to rank 0's tier, for every worker's tier ("open" makes the tier)."""

    op: str
    args: tuple


def open_tier(kv_caches: list, model_id: str, config: EngineConfig, rank: int = 0,
              size: int = 1, peers: TierPeers | None = None) -> KVTier:
    """The tier of one rank's KV cache; with several ranks each has its own disk folder."""
    folder = config.kv_offload_dir
    if folder and size > 1:
        folder = os.path.join(folder, f"tp{size}-rank{rank}")
    return KVTier(BlockIO(kv_caches, model_id), int(config.kv_offload_size_gb * (1 << 30)),
                  folder, int(config.kv_offload_disk_size_gb * (1 << 30)), peers=peers)


class GroupPeers(TierPeers):
    """The other ranks over the group's CPU channel. On rank 0 `send` broadcasts a call to the
    workers (under the executor's lock, which `lock` is, so no other message cuts in between a
    restore and its agreement); on a worker `send` is None."""

    def __init__(self, group, send: Callable[[object], None] | None = None,
                 lock: threading.Lock | None = None):
        self.group = group
        self.send = send
        self.lock = lock or threading.Lock()

    def mirror(self, op: str, *args) -> None:
        if self.send is not None:
            with self.lock:
                self.send(TierCall(op, args))

    def agree(self, call: tuple, restored: Callable[[], int]) -> int:
        with self.lock:
            if self.send is not None:
                self.send(TierCall(call[0], call[1:]))
            count = torch.tensor([restored()], dtype=torch.int64)
            dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self.group.cpu_group)
            return int(count.item())


class WorkerTier:
    """A worker's side: applies rank 0's calls to this rank's tier."""

    def __init__(self, runner, config: EngineConfig, group):
        self.runner, self.config, self.group = runner, config, group
        self.tier: KVTier | None = None

    def apply(self, call: TierCall) -> None:
        if call.op == "open":
            self.tier = open_tier(self.runner.kv_caches, call.args[0], self.config,
                                  self.group.rank, self.group.size, GroupPeers(self.group))
            return
        getattr(self.tier, call.op)(*call.args)
        self.tier.take_events()  # published by rank 0 alone

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
