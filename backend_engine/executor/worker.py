"""Ranks 1..N-1 of a tensor-parallel replica: join the group, load this rank's shard and KV
cache, report through the store, then run every step rank 0 sends until it says stop or goes
away. Signals meant for the replica (Ctrl-C in a terminal, a supervisor's SIGTERM to the process
group) are left to rank 0, which drains and then stops the workers; a worker whose rank 0 is
gone exits by itself."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig

from backend_engine.config import EngineConfig
from backend_engine.distributed.group import TensorParallelGroup, init_group
from backend_engine.kv_tier.peers import TierCall, WorkerTier
from backend_engine.model_runner import ModelRunner

STOP, PING = "stop", "ping"  # control messages on the step broadcast


@dataclasses.dataclass(frozen=True, slots=True)
class BlockCopies:
    """Copy these whole KV blocks (source id, destination id) on every rank, before the next
    step (a partial prefix-cache hit: partial_block.py)."""

    pairs: list[tuple[int, int]]


START_TIMEOUT_S = 900.0  # loading a large shard; the supervisor's health timeout applies too

log = logging.getLogger("kvgate.engine.tp")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r of a CUDA replica uses the r-th device after the one configured (cuda → cuda:r)."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config one rank runs with: its own device; on CPU its share of the cores, since N
    processes that each use every core collapse."""
    device = rank_device(config.device, rank)
    threads = config.num_threads
    if device.type == "cpu" and threads is None:
        threads = max(1, available_cores() // config.tensor_parallel_size)
    return dataclasses.replace(config, device=str(device), num_threads=threads)


def _exit_with_parent() -> None:
    """If rank 0 dies without stopping us (SIGKILL), leave too: nothing else would end us."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name="kvgate-tp-parent", daemon=True).start()


def run_worker(rank: int, size: int, store_port: int, config: EngineConfig, folder: Path,
               max_model_len: int) -> None:
    """The process entry point (spawned by the executor on rank 0)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent()
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False,
                          timeout=timedelta(seconds=START_TIMEOUT_S))
    store.set(f"joined/{rank}", "1")
    try:
        config = rank_config(config, rank)
        group = init_group(store, rank, size, torch.device(config.device))
        runner = ModelRunner(config, folder, AutoConfig.from_pretrained(folder), max_model_len,
                             tp=group)
    except Exception as exc:  # rank 0 reports it: the user reads one message, not N logs
        store.set(f"ready/{rank}", json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        raise SystemExit(1) from None
    store.set(f"ready/{rank}", json.dumps({"num_blocks": runner.num_blocks}))
    store.wait(["go"])
    serve_steps(group, runner, WorkerTier(runner, config, group))
    # Stopped: leave without tearing the interpreter down. Nothing here needs cleaning (rank 0
    # ends the group), and destroying gloo's objects at exit can abort the process.
    logging.shutdown()
    os._exit(0)


def serve_steps(group: TensorParallelGroup, runner: ModelRunner, tier: WorkerTier) -> None:
    while True:
        try:
            message = group.receive_step()
        except RuntimeError as exc:  # rank 0 went away (its process ended or was killed)
            log.error("lost rank 0, exiting: %s", str(exc).splitlines()[0])
            os._exit(1)
        if message == STOP:
            tier.close()  # its queued disk writes first
            return
        if isinstance(message, BlockCopies):
            runner.copy_blocks(message.pairs)
        elif isinstance(message, TierCall):
            tier.apply(message)
        elif message != PING:
            runner.forward_batch(message)
