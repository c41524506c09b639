"""Continuous batching with chunked prefill (vLLM V1 style): there is no prefill or decode
phase. Each sequence has num_computed_tokens; each step hands out one token budget, running
sequences first, then waiting ones. Preemption is by recompute: the newest running sequence
gives back its blocks and rejoins the front of the queue. The scheduler never touches tensors."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from backend_engine.config import EngineConfig
from backend_engine.kv_cache_manager import KVCacheManager
from backend_engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, new tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.long_prefill_threshold = config.long_prefill_token_threshold
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def pending_prefill_tokens(self) -> int:
        waiting = sum(s.num_tokens - s.num_computed_tokens for s in self.waiting)
        running = sum(max(0, s.num_prompt_tokens - s.num_computed_tokens) for s in self.running)
        return waiting + running

    def _cap(self, n: int, budget: int) -> int:
        if self.long_prefill_threshold > 0:
            n = min(n, self.long_prefill_threshold)
        return min(n, budget)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._cap(seq.num_tokens_with_spec - seq.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        held_back: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            parent = seq.parent
            parent_running = parent is not None and parent.status is SequenceStatus.RUNNING
            if parent_running and parent.is_prefilling:
                held_back.append(self.waiting.popleft())  # fork once the prompt is computed
                continue
            if parent_running and seq.num_computed_tokens == 0:
                blocks, hit = self.kv.fork_blocks(parent, seq)
            else:
                blocks, hit = self.kv.get_computed_blocks(seq)
            n = self._cap(seq.num_tokens - seq.num_computed_tokens - hit, budget)
            if not self.kv.allocate_slots(seq, n, blocks):
                break
            self.waiting.popleft()
            self.kv.record_lookup(seq.num_tokens, hit)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = hit
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(held_back))

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Mark finished and free its blocks at once; it leaves the queues on the next sweep."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.kv.free(seq)

    def sweep_finished(self) -> None:
        if any(s.is_finished for s in self.running):
            self.running = [s for s in self.running if not s.is_finished]
        if any(s.is_finished for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
