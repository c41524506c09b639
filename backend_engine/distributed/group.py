"""The tensor-parallel process group. Model tensors travel on the device group (NCCL between
GPUs, gloo on CPU); the step description, a small Python object, always travels on a gloo group,
so idle workers wait on the CPU and notice at once when rank 0 goes away."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Any one collective longer than this means a rank hung: the replica goes down rather than
# waiting forever. Idle workers never get near it: rank 0 pings them (executor.KEEPALIVE_S).
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass(slots=True)
class CommStats:
    """Time rank 0 spent inside collectives (waiting for slower ranks included). On CUDA only
    the launches are timed: NCCL runs asynchronously to the host."""

    seconds: float = 0.0
    calls: int = 0


class TensorParallelGroup:
    def __init__(self, rank: int = 0, size: int = 1, device_group=None, cpu_group=None):
        self.rank = rank
        self.size = size
        self.device_group = device_group
        self.cpu_group = cpu_group
        self.stats = CommStats()

    def _count(self, started: float) -> None:
        self.stats.seconds += time.perf_counter() - started
        self.stats.calls += 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        if self.size > 1:
            started = time.perf_counter()
            dist.all_reduce(x, group=self.device_group)
            self._count(started)
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (same shape) on rank 0, in rank order; None on the other ranks."""
        if self.size == 1:
            return [x]
        started = time.perf_counter()
        shards = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, shards, dst=0, group=self.device_group)
        self._count(started)
        return shards

    def send_step(self, message: object) -> None:
        """Rank 0: hand the next step (or a control message) to every worker."""
        started = time.perf_counter()
        dist.broadcast_object_list([message], src=0, group=self.cpu_group)
        self._count(started)

    def receive_step(self) -> object:
        """Workers: wait for rank 0's next message."""
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


SINGLE = TensorParallelGroup()


def init_group(store: dist.Store, rank: int, size: int,
               device: torch.device) -> TensorParallelGroup:
    """Join the group through the store rank 0 serves; every rank calls this once."""
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel group already runs in this process "
                           "(one tensor-parallel engine per process)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    return TensorParallelGroup(rank, size, dist.group.WORLD, cpu_group)
