"""Continuous batching with chunked prefill (vLLM V1 style): there is no prefill or decode
phase. Each sequence has num_computed_tokens; each step hands out one token budget, running
sequences first, then waiting ones. Preemption is by recompute: the victim gives back its blocks
and rejoins the front of its class in the waiting queue. The scheduler never touches tensors.

Priority (scheduling_policy "priority", vLLM's semantics: lower value first): both queues are
kept in priority order, then arrival, so the budget goes to urgent work first and the victim of a
block shortage is the least urgent, newest sequence. A waiting sequence that finds the seats,
blocks or budget taken by strictly less urgent running work takes them: those sequences skip the
step (budget) or are preempted (seats, blocks). Only strictly less urgent work ever yields, and a
step never re-admits what it preempted, so preemption cannot cycle. With one priority class this
is exactly FCFS ("fcfs" ignores priorities altogether).

With a step budget (an inter-token latency target, step_budget.py), prefill chunks share the time
the running decodes leave in the step, and a waiting sequence starts only while the decode step it
joins stays inside the target; without one, every step hands out max_num_batched_tokens.

A waiting sequence whose prefix is being read from the disk KV tier (kv_tier/staging.py) is
passed over, holding no blocks, until the read is done; the sequences behind it go ahead."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from backend_engine.config import EngineConfig
from backend_engine.kv_cache_manager import KVCacheManager
from backend_engine.sequence import Sequence, SequenceStatus
from backend_engine.step_budget import DecodeLoad, StepBudget
from backend_engine.waiting_queue import WaitingQueue


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, new tokens)
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 step_budget: StepBudget | None = None):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.long_prefill_threshold = config.long_prefill_token_threshold
        self.use_priority = config.scheduling_policy == "priority"
        self.kv = kv
        self.waiting = WaitingQueue(self.rank)
        self.running: list[Sequence] = []  # serving order: priority, then admission
        self.num_preemptions = 0
        self.step_budget = step_budget
        self._budget = 0  # tokens left in the step being scheduled
        self._prefill = _PrefillTime(step_budget)  # prefill time left in that step

    def rank(self, seq: Sequence) -> int:
        """The sequence's priority class; one class for everything under FCFS."""
        return seq.priority if self.use_priority else 0

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

    @staticmethod
    def _prefilling(seq: Sequence) -> bool:
        """More than one token of its own to compute (a prompt chunk or a recompute)."""
        return seq.num_tokens - seq.num_computed_tokens > 1

    def decode_load(self) -> DecodeLoad:
        """The rows and context of the running sequences that decode this step."""
        load = DecodeLoad()
        for seq in self.running:
            if not self._prefilling(seq):
                load.rows += 1 + len(seq.spec_token_ids)
                load.context_tokens += seq.num_tokens
        return load

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._budget = self.max_num_batched_tokens
        self._prefill.begin(self.decode_load() if self.step_budget is not None else None)
        i = 0
        while i < len(self.running) and self._budget > 0:
            seq = self.running[i]
            n = self._cap(seq.num_tokens_with_spec - seq.num_computed_tokens, self._budget)
            if self._prefilling(seq):
                n = self._prefill.cap(n, seq.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(seq, n):
                victim = self.running.pop()  # the least urgent, newest
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, n))
                self._budget -= n
                if self._prefilling(seq):
                    self._prefill.charge(seq, n)
                i += 1
                continue
            break
        self._schedule_waiting(out)
        return out

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        held_back: list[Sequence] = []
        seats = DecodeLoad(len(self.running), sum(s.num_tokens for s in self.running))
        while self.waiting:
            seq = self.waiting.peek()
            rank = self.rank(seq)
            if out.preempted and rank >= min(self.rank(s) for s in out.preempted):
                break  # never re-admit in the step that preempted it (nor what queues behind)
            parent = seq.parent
            parent_running = parent is not None and parent.status is SequenceStatus.RUNNING
            if parent_running and parent.is_prefilling:
                held_back.append(self.waiting.popleft())  # fork once the prompt is computed
                continue
            if not parent_running and self.kv.waiting_for_kv(seq):
                held_back.append(self.waiting.popleft())  # its prefix is being read from disk
                continue
            partial = None
            if parent_running and seq.num_computed_tokens == 0:
                blocks, hit = self.kv.fork_blocks(parent, seq)
            else:
                blocks, hit = self.kv.get_computed_blocks(seq)
                partial = self.kv.partial_hit(seq, blocks)
                hit += partial.num_tokens if partial else 0
            if self.step_budget is not None and not self.step_budget.admits(seats, seq.num_tokens):
                break  # one more running sequence would push every decode past the ITL target
            want = self._cap(seq.num_tokens - seq.num_computed_tokens - hit,
                             self.max_num_batched_tokens)
            want = self._prefill.cap(want, seq.num_computed_tokens + hit)
            budget = self._budget
            if want > budget:
                budget += self._yieldable(out, rank)
            n = min(want, budget)
            if n <= 0 or not self._room_after_preempting(seq, rank, n, blocks, partial):
                break  # nothing is taken from anyone for a request that still could not start
            self._yield_budget(out, rank, n)
            while len(self.running) >= self.max_num_seqs and self._preempt_below(out, rank):
                pass
            while not self.kv.allocate_slots(seq, n, blocks, partial):
                if not self._preempt_below(out, rank):
                    break
            else:
                self.waiting.popleft()
                self.kv.record_lookup(seq.num_tokens, hit)
                if seq.num_cached_tokens < 0:
                    seq.num_cached_tokens = hit
                seq.status = SequenceStatus.RUNNING
                bisect.insort_right(self.running, seq, key=self.rank)
                out.scheduled.append((seq, n))
                self._budget -= n
                self._prefill.charge(seq, n)
                seats.rows += 1
                seats.context_tokens += seq.num_tokens
                continue
            break
        for seq in reversed(held_back):
            self.waiting.appendleft(seq)

    def _yieldable(self, out: SchedulerOutput, rank: int) -> int:
        return sum(n for seq, n in out.scheduled if self.rank(seq) > rank)

    def _room_after_preempting(self, seq: Sequence, rank: int, n: int, blocks, partial) -> bool:
        """Whether seats and blocks suffice once every strictly less urgent sequence yields."""
        need = self.kv.num_blocks_needed(seq, n, blocks, partial)
        free = self.kv.pool.num_free_blocks
        if len(self.running) < self.max_num_seqs and need <= free:
            return True  # the common case: nobody has to yield anything
        victims = [v for v in self.running if self.rank(v) > rank]
        if len(self.running) - len(victims) >= self.max_num_seqs:
            return False
        if need <= free:
            return True
        return need <= free + self.kv.reclaimable(victims, blocks)

    def _yield_budget(self, out: SchedulerOutput, rank: int, want: int) -> None:
        """Take budget back from strictly less urgent sequences scheduled in this step (they
        keep their blocks and run in a later step), least urgent first."""
        j = len(out.scheduled) - 1
        while self._budget < want and j >= 0:
            seq, n = out.scheduled[j]
            if self.rank(seq) > rank:
                del out.scheduled[j]
                self._unschedule(seq, n)
            j -= 1

    def _preempt_below(self, out: SchedulerOutput, rank: int) -> bool:
        """Preempt the least urgent running sequence if it is strictly less urgent than rank."""
        if not self.running or self.rank(self.running[-1]) <= rank:
            return False
        victim = self.running.pop()
        for j, (seq, n) in enumerate(out.scheduled):
            if seq is victim:
                del out.scheduled[j]
                self._budget += n
                self._prefill.refund(seq)
                break
        self._preempt(victim)
        out.preempted.append(victim)
        return True

    def _unschedule(self, seq: Sequence, n: int) -> None:
        self._budget += n
        self._prefill.refund(seq)
        if seq.spec_token_ids:  # unverified drafts are proposed again next step
            seq.spec_token_ids = []
            seq.spec_draft_probs = None
            self.kv.trim_to(seq, seq.num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.spec_token_ids = []
        seq.spec_draft_probs = None
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
        self.waiting.remove_finished()


class _PrefillTime:
    """The prefill time of the step being scheduled: what the step budget leaves after the
    running decodes, charged per chunk by its modelled cost, with a floor
    (`StepBudget.floor_tokens`) a step so prefill never stalls. Inert without a step budget."""

    def __init__(self, budget: StepBudget | None):
        self.budget = budget
        self.seconds = 0.0
        self.tokens = 0
        self.floor = budget.min_prefill_tokens if budget is not None else 0
        self.charged: dict[Sequence, tuple[int, float]] = {}

    def begin(self, load: DecodeLoad | None) -> None:
        self.charged.clear()
        self.tokens = 0
        if self.budget is not None and load is not None:
            self.seconds = self.budget.prefill_seconds(load)
            self.floor = self.budget.floor_tokens

    def cap(self, n: int, cached_context: int) -> int:
        if self.budget is None:
            return n
        allowed = self.budget.chunk_tokens(self.seconds, cached_context)
        allowed = max(allowed, self.floor - self.tokens)
        if allowed > 0:  # the padding rows of the step's last granule are computed anyway
            allowed = self.budget.whole_granules(self.tokens + allowed) - self.tokens
        return max(0, min(n, allowed))

    def charge(self, seq: Sequence, n: int) -> None:
        if self.budget is None:
            return
        cost = self.budget.chunk_seconds(n, seq.num_computed_tokens)
        self.seconds = max(0.0, self.seconds - cost)
        self.tokens += n
        self.charged[seq] = (n, cost)

    def refund(self, seq: Sequence) -> None:
        n, cost = self.charged.pop(seq, (0, 0.0))
        self.seconds += cost
        self.tokens -= n
