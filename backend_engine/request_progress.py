"""Where a request stands in the engine, for a gateway whose stream from this replica has gone
silent: running (scheduled, its computed tokens advancing), preempted (back in the waiting queue
after it ran), waiting (not yet scheduled), or finished. Read from the event loop without
stopping the engine thread: a hung or slow step must not delay the answer."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from backend_engine.sequence import Sequence, SequenceStatus

RUNNING, PREEMPTED, WAITING, FINISHED = "running", "preempted", "waiting", "finished"
_LIVENESS = (RUNNING, PREEMPTED, WAITING, FINISHED)  # the most alive first


@dataclass(slots=True)
class RequestProgress:
    state: str
    num_prompt_tokens: int
    num_computed_tokens: int  # prompt and output tokens whose K/V are computed
    num_output_tokens: int
    num_preemptions: int
    since_progress_s: float  # since a step last computed its tokens (else since it arrived)

    def to_dict(self) -> dict:
        return asdict(self)


def _state(seq: Sequence) -> str:
    if seq.status is SequenceStatus.RUNNING:
        return RUNNING
    if seq.status is SequenceStatus.FINISHED:
        return FINISHED
    return PREEMPTED if seq.num_preemptions else WAITING


def progress_of(seqs: Iterable[Sequence], now: float | None = None) -> RequestProgress | None:
    """The progress of these sequences (every sample of one or more engine requests), as the
    most alive of them: running if any runs. None when there are none."""
    seqs = list(seqs)
    if not seqs:
        return None
    now = time.monotonic() if now is None else now
    state = min((_state(s) for s in seqs), key=_LIVENESS.index)
    last = max(s.progress_time or s.arrival_time for s in seqs)
    return RequestProgress(state, sum(s.num_prompt_tokens for s in seqs),
                           sum(s.num_computed_tokens for s in seqs),
                           sum(s.num_output_tokens for s in seqs),
                           sum(s.num_preemptions for s in seqs), round(max(0.0, now - last), 3))
