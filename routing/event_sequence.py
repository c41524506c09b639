"""Sequence numbers of one ZMQ event stream (one publisher, one DP rank), as vLLM numbers them:
0, 1, 2, … from the publisher's start, one per batch. What a subscriber does with the next one."""

from __future__ import annotations

from enum import Enum


class Step(Enum):
    APPLY = "apply"  # the next batch (or the first one seen): apply it
    GAP = "gap"  # batches were missed: ask the replay endpoint from `expected`
    RESTART = "restart"  # the number went back: a new publisher; forget its old blocks
    DUPLICATE = "duplicate"  # already applied (a replay overlapping live batches)


class EventSequence:
    def __init__(self) -> None:
        self.expected: int | None = None  # None: nothing applied since start or reset

    def step(self, seq: int, replaying: bool = False) -> Step:
        """Classify `seq`; while `replaying`, an older number is a duplicate, not a restart."""
        expected = self.expected
        if expected is None or seq == expected:
            return Step.APPLY
        if seq > expected:
            return Step.GAP
        return Step.DUPLICATE if replaying else Step.RESTART

    def applied(self, seq: int) -> None:
        self.expected = seq + 1

    def reset(self) -> None:
        self.expected = None
