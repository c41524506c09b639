"""A request's progress as a silent stream's gateway sees it: the most alive of its samples."""

from __future__ import annotations

from backend_engine.request_progress import progress_of
from backend_engine.sampling_params import SamplingParams
from backend_engine.sequence import Sequence, SequenceStatus


def seq(status: SequenceStatus, computed: int = 0, preemptions: int = 0,
        progress: float | None = None) -> Sequence:
    s = Sequence("r-0", "r", 0, [1, 2, 3, 4], SamplingParams(), "ns", 16, status=status,
                 num_computed_tokens=computed, num_preemptions=preemptions, arrival_time=100.0,
                 progress_time=progress)
    return s


def test_a_running_sample_makes_the_request_running_with_its_last_progress():
    p = progress_of([seq(SequenceStatus.FINISHED, 6, progress=101.0),
                     seq(SequenceStatus.RUNNING, 5, progress=103.0)], now=104.5)
    assert p.state == "running" and p.num_computed_tokens == 11 and p.since_progress_s == 1.5
    assert p.num_prompt_tokens == 8


def test_a_sample_back_in_the_waiting_queue_after_running_is_preempted():
    p = progress_of([seq(SequenceStatus.WAITING, 0, preemptions=1, progress=102.0)], now=110.0)
    assert p.state == "preempted" and p.num_preemptions == 1 and p.since_progress_s == 8.0


def test_never_scheduled_is_waiting_since_arrival_and_all_done_is_finished():
    assert progress_of([seq(SequenceStatus.WAITING)], now=100.25).state == "waiting"
    assert progress_of([seq(SequenceStatus.WAITING)], now=100.25).since_progress_s == 0.25
    assert progress_of([seq(SequenceStatus.FINISHED)], now=101.0).state == "finished"
    assert progress_of([], now=1.0) is None
