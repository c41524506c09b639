"""Scheduler priority: order, budget, preemption of less urgent work only, no leaks, and FCFS
unchanged when every request has the same priority. No model: sequences are stepped by hand."""

import random

import pytest

from backend_engine.block_pool import BlockPool
from backend_engine.config import EngineConfig
from backend_engine.kv_cache_manager import KVCacheManager
from backend_engine.sampling_params import SamplingParams
from backend_engine.scheduler import Scheduler
from backend_engine.sequence import Sequence, SequenceStatus

B = 4  # block size


def make_scheduler(num_blocks=64, max_num_seqs=8, budget=64, policy="priority") -> Scheduler:
    config = EngineConfig(enforce_eager=True, block_size=B, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget, scheduling_policy=policy)
    return Scheduler(config, KVCacheManager(BlockPool(num_blocks, enable_caching=False), B))


def make_seq(name: str, prompt_len: int, priority: int = 0, max_tokens: int = 4) -> Sequence:
    return Sequence(name, name, 0, list(range(1, prompt_len + 1)), SamplingParams(), "m",
                    max_tokens, priority=priority)


def step(s: Scheduler):
    """One engine step without a model: computed tokens advance, a token is sampled once a
    sequence's tokens are all computed, and it finishes at max_tokens."""
    out = s.schedule()
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens >= seq.num_tokens:
            seq.append_token(7)
            if seq.num_output_tokens >= seq.max_tokens:
                s.finish(seq, "length")
    s.sweep_finished()
    return out


def names(pairs) -> list[str]:
    return [seq.seq_id for seq, _ in pairs]


def assert_pool_empty(s: Scheduler) -> None:
    pool = s.kv.pool
    assert not s.has_unfinished()
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = make_scheduler()
    for seq in (make_seq("batch", 4, 5), make_seq("hi-1", 4, 0), make_seq("mid", 4, 2),
                make_seq("hi-2", 4, 0)):
        s.add(seq)
    assert names(s.schedule().scheduled) == ["hi-1", "hi-2", "mid", "batch"]
    assert [q.seq_id for q in s.running] == ["hi-1", "hi-2", "mid", "batch"]


def test_negative_priorities_are_more_urgent():
    s = make_scheduler()
    s.add(make_seq("zero", 4, 0))
    s.add(make_seq("minus", 4, -3))
    assert names(s.schedule().scheduled) == ["minus", "zero"]


def test_fcfs_policy_ignores_priority():
    s = make_scheduler(policy="fcfs")
    for seq in (make_seq("batch", 4, 5), make_seq("hi", 4, 0)):
        s.add(seq)
    assert names(s.schedule().scheduled) == ["batch", "hi"]


def test_running_sequences_get_the_budget_in_priority_order():
    s = make_scheduler(budget=3)
    for name, prio in (("lo-a", 3), ("lo-b", 3), ("hi", 0)):
        s.add(make_seq(name, 1, prio, max_tokens=50))
    step(s)  # three one-token prefills, everyone decodes from now on
    s.add(make_seq("hi-2", 1, 0, max_tokens=50))
    out = step(s)
    assert names(out.scheduled) == ["hi", "lo-a", "hi-2"]  # lo-b, the least urgent newest, waits
    assert not out.preempted
    out = step(s)
    assert names(out.scheduled) == ["hi", "hi-2", "lo-a"]


def test_a_waiting_urgent_request_takes_the_budget_from_less_urgent_decodes():
    s = make_scheduler(budget=8, max_num_seqs=16)
    batch = [make_seq(f"batch-{i}", 1, 10, max_tokens=50) for i in range(8)]
    for seq in batch:
        s.add(seq)
    step(s)
    s.add(make_seq("chat", 5, 0))
    out = step(s)
    assert names(out.scheduled)[-1] == "chat" and out.scheduled[-1][1] == 5
    skipped = {q.seq_id for q in batch} - set(names(out.scheduled))
    assert skipped == {f"batch-{i}" for i in range(3, 8)}  # the newest batch work waits a step
    assert not out.preempted
    assert all(q.status is SequenceStatus.RUNNING for q in batch)  # skipped, not preempted
    assert s.kv.pool.num_free_blocks == 64 - 8 - 2


def test_full_seats_preempt_the_least_urgent_newest_running_sequence():
    s = make_scheduler(max_num_seqs=2)
    older, newer = make_seq("batch-old", 4, 9, 50), make_seq("batch-new", 4, 9, 50)
    s.add(older)
    s.add(newer)
    step(s)
    chat = make_seq("chat", 4, 0)
    s.add(chat)
    out = step(s)
    assert out.preempted == [newer]
    assert names(out.scheduled) == ["batch-old", "chat"]
    assert newer.block_table == [] and newer.num_computed_tokens == 0
    assert newer.status is SequenceStatus.WAITING and s.waiting.peek() is newer


def test_equal_or_lower_priority_never_preempts_running_work():
    s = make_scheduler(max_num_seqs=2)
    for name in ("a", "b"):
        s.add(make_seq(name, 4, 3, 50))
    step(s)
    s.add(make_seq("same", 4, 3))
    s.add(make_seq("less", 4, 8))
    out = step(s)
    assert not out.preempted and names(out.scheduled) == ["a", "b"]
    assert len(s.waiting) == 2


def test_block_shortage_preempts_only_less_urgent_sequences():
    # 6 blocks: "hi" holds 2, "lo" holds 2, then each grows one block per 4 tokens.
    s = make_scheduler(num_blocks=6)
    hi, lo = make_seq("hi", 8, 0, 50), make_seq("lo", 8, 1, 50)
    s.add(lo)
    s.add(hi)
    step(s)
    assert [q.seq_id for q in s.running] == ["hi", "lo"]
    preempted = []
    for _ in range(12):
        preempted += step(s).preempted
    assert preempted and all(p is lo for p in preempted)
    assert hi.num_preemptions == 0


def test_a_waiting_urgent_request_preempts_for_blocks():
    s = make_scheduler(num_blocks=4)
    lo = make_seq("lo", 12, 5, 50)  # 3 of the 4 blocks
    s.add(lo)
    step(s)
    chat = make_seq("chat", 8, 0)  # needs 2 blocks: only 1 free
    s.add(chat)
    out = step(s)
    assert out.preempted == [lo] and names(out.scheduled) == ["chat"]
    assert lo.block_table == [] and s.kv.pool.num_free_blocks == 4 - 2


def test_nothing_is_preempted_for_a_request_that_still_would_not_fit():
    s = make_scheduler(num_blocks=6)
    hi, lo = make_seq("hi", 7, 0, 50), make_seq("lo", 7, 5, 50)  # 2 blocks each
    s.add(hi)
    s.add(lo)
    step(s)
    s.add(make_seq("urgent", 20, 0))  # 5 blocks: 2 free + 2 of "lo" are not enough
    out = step(s)
    assert not out.preempted and names(out.scheduled) == ["hi", "lo"]
    assert lo.num_preemptions == 0


def test_preempted_work_is_not_readmitted_in_the_same_step():
    s = make_scheduler(num_blocks=4, max_num_seqs=1)
    lo = make_seq("lo", 4, 5, 50)
    s.add(lo)
    step(s)
    s.add(make_seq("chat", 4, 0))
    out = step(s)
    assert out.preempted == [lo] and names(out.scheduled) == ["chat"]
    assert lo in list(s.waiting)


def run_to_completion(s: Scheduler, seqs, max_steps=5000, arrivals=None):
    trace = []
    arrivals = dict(arrivals or {})
    for t in range(max_steps):
        for seq in arrivals.pop(t, []):
            s.add(seq)
        if not s.has_unfinished() and not arrivals:
            return trace
        out = step(s)
        trace.append((names(out.scheduled), [n for _, n in out.scheduled],
                      [p.seq_id for p in out.preempted]))
    raise AssertionError("the scheduler did not finish (livelock?)")


def workload(seed: int, priorities) -> dict[int, list[Sequence]]:
    rng = random.Random(seed)
    arrivals: dict[int, list[Sequence]] = {}
    for i in range(40):
        seq = make_seq(f"r{i}", rng.randint(1, 30), rng.choice(priorities), rng.randint(1, 40))
        arrivals.setdefault(rng.randint(0, 60), []).append(seq)
    return arrivals


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equal_priorities_schedule_exactly_like_fcfs(seed):
    kwargs = dict(num_blocks=24, max_num_seqs=6, budget=16)
    fcfs = run_to_completion(make_scheduler(policy="fcfs", **kwargs), None,
                             arrivals=workload(seed, [0]))
    prio = run_to_completion(make_scheduler(policy="priority", **kwargs), None,
                             arrivals=workload(seed, [4]))
    assert any(p for _, _, p in fcfs), "the workload should preempt"
    assert prio == fcfs


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_mixed_priorities_finish_without_livelock_or_leaks(seed):
    s = make_scheduler(num_blocks=24, max_num_seqs=6, budget=16)
    arrivals = workload(seed, [0, 1, 5])
    everything = [q for batch in arrivals.values() for q in batch]
    trace = run_to_completion(s, None, arrivals=arrivals)
    assert all(q.is_finished for q in everything)
    assert any(p for _, _, p in trace)
    assert_pool_empty(s)
    for scheduled, counts, preempted in trace:
        assert sum(counts) <= 16
        assert len(set(scheduled)) == len(scheduled)
        assert not set(scheduled) & set(preempted)


def test_unknown_scheduling_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(enforce_eager=True, scheduling_policy="lifo").validate()
