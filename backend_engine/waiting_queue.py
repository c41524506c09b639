"""The scheduler's waiting queue: one FIFO per priority class, served lowest value first.

A new sequence joins the back of its class, a preempted one the front, so with one class the
queue is exactly the FCFS deque it replaces. Every operation is O(1) in the queue's length
(O(number of classes) to find the head), so a flood of batch requests costs nothing extra."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator

from backend_engine.sequence import Sequence


class WaitingQueue:
    def __init__(self, rank: Callable[[Sequence], int]):
        self.rank = rank  # the sequence's priority class (lower is served first)
        self._classes: dict[int, deque[Sequence]] = {}
        self._order: list[int] = []  # the non-empty classes, ascending
        self._len = 0

    def _class(self, seq: Sequence) -> deque[Sequence]:
        rank = self.rank(seq)
        queue = self._classes.get(rank)
        if queue is None:
            queue = self._classes[rank] = deque()
            bisect.insort(self._order, rank)
        return queue

    def append(self, seq: Sequence) -> None:
        """A new arrival: behind every waiting sequence of its class."""
        self._class(seq).append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        """A preempted (or held-back) sequence: ahead of every other of its class."""
        self._class(seq).appendleft(seq)
        self._len += 1

    def peek(self) -> Sequence:
        if not self._len:
            raise IndexError("peek from an empty waiting queue")
        return self._classes[self._order[0]][0]

    def popleft(self) -> Sequence:
        rank = self._order[0]
        queue = self._classes[rank]
        seq = queue.popleft()
        self._len -= 1
        if not queue:
            del self._classes[rank]
            self._order.pop(0)
        return seq

    def remove_finished(self) -> None:
        for rank in list(self._order):
            queue = self._classes[rank]
            if any(s.is_finished for s in queue):
                kept = deque(s for s in queue if not s.is_finished)
                self._len -= len(queue) - len(kept)
                if kept:
                    self._classes[rank] = kept
                else:
                    del self._classes[rank]
                    self._order.remove(rank)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        """In serving order."""
        for rank in self._order:
            yield from self._classes[rank]
