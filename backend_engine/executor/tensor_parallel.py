"""Rank 0 of a tensor-parallel replica, in the engine's process, where the runner would be. It
starts ranks 1..N-1 (torch.multiprocessing, spawn), serves the store they meet through, loads
its own shard while they load theirs, and then, for every step, broadcasts the StepBatch and
runs its shard, whose collectives the workers join. A monitor thread watches the workers: one
that dies takes the replica down (check_health and the next step raise, the engine loop stops,
/health answers 503 and the server exits for its supervisor to restart the whole group)."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_exit
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backend_engine.config import EngineConfig
from backend_engine.distributed.group import init_group
from backend_engine.distributed.sharding import check_tensor_parallel_size
from backend_engine.errors import EngineError, ModelLoadError
from backend_engine.executor.worker import (PING, START_TIMEOUT_S, STOP, BlockCopies,
                                            rank_config, rank_device, run_worker)
from backend_engine.model_runner import ModelRunner, SeqResult, StepInputs
from backend_engine.sampler import SamplingRow
from backend_engine.sequence import Sequence
from backend_engine.step_batch import StepBatch

KEEPALIVE_S = 10.0  # idle workers wait inside a collective: ping them well inside its timeout
STOP_GRACE_S = 10.0

log = logging.getLogger("kvgate.engine.tp")


class WorkerDiedError(EngineError):
    """A tensor-parallel rank is gone; the replica cannot compute any more."""


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class TensorParallelExecutor:
    """The engine's runner when tensor_parallel_size > 1: same surface as ModelRunner."""

    def __init__(self, config: EngineConfig, folder: Path, hf_config, max_model_len: int,
                 model_name: str = "the model"):
        size = config.tensor_parallel_size
        check_tensor_parallel_size(hf_config, size, model_name)  # before starting anything
        _check_devices(config.device, size)
        self.size = size
        self.failure: str | None = None
        self.workers: list[mp.Process] = []
        self.group = None
        self._lock = threading.Lock()  # one thread at a time on the group
        self._closed = threading.Event()
        self._last_sent = time.monotonic()
        self._store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=START_TIMEOUT_S))
        try:
            context = mp.get_context("spawn")
            for rank in range(1, size):
                worker = context.Process(
                    target=run_worker, name=f"kvgate-tp-rank{rank}", daemon=True,
                    args=(rank, size, self._store.port, config, Path(folder), max_model_len))
                worker.start()
                self.workers.append(worker)
            self._wait_for("joined")
            self.group = init_group(self._store, 0, size, rank_device(config.device, 0))
            self.runner = ModelRunner(rank_config(config, 0), folder, hf_config, max_model_len,
                                      tp=self.group)
            self._check_ready([json.loads(v) for v in self._wait_for("ready")])
            self._store.set("go", "1")
        except BaseException:
            self._closed.set()
            self._stop_workers(0.0)
            if self.group is not None:
                self.group.close()
            raise
        self.num_blocks = self.runner.num_blocks
        self.kv_cache_groups = self.runner.kv_cache_groups  # one: hybrid freeing is off here
        _LIVE.add(self)
        for target, name in ((self._monitor, "monitor"), (self._keepalive, "keepalive")):
            threading.Thread(target=target, name=f"kvgate-tp-{name}", daemon=True).start()
        log.info("tensor parallel: %d ranks (pids %s) on %s", size,
                 ", ".join(str(w.pid) for w in self.workers), config.device)

    # -- start-up ----------------------------------------------------------------------------
    def _wait_for(self, stage: str) -> list[str]:
        """Each worker's value of `stage/RANK` in the store; raises if one dies first."""
        keys = [f"{stage}/{rank}" for rank in range(1, self.size)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._store.check(keys):
            for rank, worker in enumerate(self.workers, 1):
                if not worker.is_alive():
                    raise self._start_failure(rank, worker)
            if time.monotonic() > deadline:
                raise ModelLoadError(f"tensor-parallel ranks did not start in {START_TIMEOUT_S}s")
            time.sleep(0.05)
        return [self._store.get(key).decode() for key in keys]

    def _start_failure(self, rank: int, worker: mp.Process) -> ModelLoadError:
        key = f"ready/{rank}"
        if self._store.check([key]):
            error = json.loads(self._store.get(key)).get("error")
            if error:
                return ModelLoadError(f"tensor-parallel rank {rank} failed to load: {error}")
        return ModelLoadError(f"tensor-parallel rank {rank} (pid {worker.pid}) "
                              f"{_describe_exit(worker.exitcode)} while starting")

    def _check_ready(self, reports: list[dict]) -> None:
        for rank, report in enumerate(reports, 1):
            if "error" in report:
                raise ModelLoadError(f"tensor-parallel rank {rank} failed to load: "
                                     f"{report['error']}")
            if report["num_blocks"] != self.runner.num_blocks:
                raise ModelLoadError(f"tensor-parallel rank {rank} sized its KV cache to "
                                     f"{report['num_blocks']} blocks, rank 0 to "
                                     f"{self.runner.num_blocks}")

    # -- steps -------------------------------------------------------------------------------
    def forward(self, scheduled: list[tuple[Sequence, int]]
                ) -> tuple[StepInputs, torch.Tensor | None]:
        batch = StepBatch.of(scheduled)
        with self._step(batch):
            return self.runner.forward(scheduled, batch)

    def execute(self, scheduled: list[tuple[Sequence, int]],
                rows: dict[Sequence, list[SamplingRow]]) -> dict[Sequence, SeqResult]:
        batch = StepBatch.of(scheduled)
        with self._step(batch):
            return self.runner.execute(scheduled, rows, batch)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Every rank copies its shard of the blocks, in order with the steps."""
        with self._step(BlockCopies(pairs)):
            self.runner.copy_blocks(pairs)

    def open_kv_tier(self, model_id: str, config: EngineConfig):  # -> KVTier
        """Rank 0's KV tier; every worker opens its own, and rank 0's mirrors its changes to
        theirs (kv_tier/peers.py)."""
        from backend_engine.kv_tier.peers import GroupPeers, TierCall, open_tier

        with self._lock:
            self._send_checked(TierCall("open", (model_id,)))
        return open_tier(self.runner.kv_caches, model_id, config, 0, self.size,
                         GroupPeers(self.group, self._send_checked, self._lock))

    @contextlib.contextmanager
    def _step(self, batch: StepBatch | BlockCopies) -> Iterator[None]:
        """Send the batch; the body runs rank 0's shard, whose collectives the workers join."""
        self.check_health()
        with self._lock:
            try:
                self._send(batch)
                yield
            except RuntimeError as exc:  # a collective failed: was it a rank that went away?
                raise self._lost(exc) from exc

    def _send_checked(self, message: object) -> None:
        """Send outside a step (the caller holds the lock)."""
        self.check_health()
        try:
            self._send(message)
        except RuntimeError as exc:
            raise self._lost(exc) from exc

    def _send(self, message: object) -> None:
        self.group.send_step(message)
        self._last_sent = time.monotonic()

    def _lost(self, exc: RuntimeError) -> Exception:
        deadline = time.monotonic() + 2.0  # the monitor sees the exit within a moment
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return WorkerDiedError(self.failure) if self.failure else exc

    # -- health ------------------------------------------------------------------------------
    def check_health(self) -> None:
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    def _fail(self, reason: str) -> None:
        if self.failure is not None or self._closed.is_set():
            return
        self.failure = reason
        log.error("%s: the replica is down", reason)
        for worker in self.workers:  # the group is broken: no rank can compute any more
            if worker.is_alive():
                worker.kill()

    def _monitor(self) -> None:
        sentinels = {worker.sentinel: (rank, worker) for rank, worker in enumerate(self.workers, 1)}
        while not self._closed.is_set():
            ended = wait_for_exit(list(sentinels), timeout=0.5)
            if ended and not self._closed.is_set():
                rank, worker = sentinels[ended[0]]
                worker.join(1.0)  # reap it, for its exit code
                self._fail(f"tensor-parallel rank {rank} (pid {worker.pid}) "
                           f"{_describe_exit(worker.exitcode)}")
                return

    def _keepalive(self) -> None:
        while not self._closed.wait(KEEPALIVE_S / 4):
            if self.failure is not None:
                return
            if time.monotonic() - self._last_sent < KEEPALIVE_S:
                continue
            if not self._lock.acquire(timeout=1.0):
                continue  # a step is running: that is contact enough
            try:
                if not self._closed.is_set():
                    self._send(PING)
            except RuntimeError as exc:
                self._fail(f"lost the tensor-parallel workers: {str(exc).splitlines()[0]}")
            finally:
                self._lock.release()

    # -- shutdown ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers (they finish the step in flight first) and leave the group."""
        if self._closed.is_set():
            return
        self._closed.set()
        _LIVE.discard(self)
        grace = STOP_GRACE_S
        if self.failure is None and self._lock.acquire(timeout=STOP_GRACE_S):
            try:
                self.group.send_step(STOP)
            except RuntimeError:
                grace = 0.0
            finally:
                self._lock.release()
        else:
            grace = 0.0
        self._stop_workers(grace)
        self.group.close()

    def _stop_workers(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():  # workers ignore SIGTERM (it is meant for rank 0): SIGKILL
                worker.kill()
                worker.join(5.0)


def _check_devices(device: str, size: int) -> None:
    last = rank_device(device, size - 1)
    if last.type == "cuda" and last.index >= torch.cuda.device_count():
        raise ModelLoadError(f"tensor_parallel_size {size} on {device} needs CUDA devices up to "
                             f"{last}, but {torch.cuda.device_count()} are visible")


# Stop workers before multiprocessing's own exit handler joins them (they ignore its SIGTERM).
# Registered after multiprocessing's handler, so it runs first.
_LIVE: weakref.WeakSet[TensorParallelExecutor] = weakref.WeakSet()
atexit.register(lambda: [executor.shutdown() for executor in list(_LIVE)])
