"""Requests every replica refused for load (503 `engine_overloaded` + Retry-After) wait here,
first come first served, instead of failing: the head retries routing when a request finishes
somewhere or its Retry-After passes, the others wait their turn, and a request that arrives
while the queue is not empty joins its end rather than overtaking it. Bounded in length and in
wait; past either bound the client gets the 503 itself. Routing late, when a replica has room,
also gives the request to whichever replica frees first, with the freshest prefix index."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

MAX_RETRY_WAIT_S = 1.0  # the head re-checks at least this often, whatever Retry-After said


class QueueFull(Exception):
    """The overload queue is at capacity."""


class QueueTimeout(Exception):
    """A request waited its maximum and no replica took it."""


@dataclass(eq=False)
class Ticket:
    request_id: str
    entered: float = field(default_factory=time.monotonic)
    turn: asyncio.Event = field(default_factory=asyncio.Event)  # set when it is the head


class OverloadQueue:
    def __init__(self, capacity: int, max_wait_s: float):
        self.capacity = capacity
        self.max_wait_s = max_wait_s
        self._tickets: deque[Ticket] = deque()
        self._freed = asyncio.Event()  # a request finished on some replica
        self.total_queued = 0
        self.total_timed_out = 0
        self.total_rejected_full = 0
        self.waits: deque[float] = deque(maxlen=512)  # seconds, of requests that left it served

    def __len__(self) -> int:
        return len(self._tickets)

    def notify_freed(self) -> None:
        """Some replica finished a request: the head may find room now."""
        self._freed.set()

    @asynccontextmanager
    async def holding(self, request_id: str):
        """A place in the queue for the duration of the block (raises QueueFull)."""
        if len(self._tickets) >= self.capacity:
            self.total_rejected_full += 1
            raise QueueFull(f"{len(self._tickets)} requests are already waiting for a replica")
        ticket = Ticket(request_id)
        self._tickets.append(ticket)
        self.total_queued += 1
        if len(self._tickets) == 1:
            ticket.turn.set()
        served = False
        try:
            yield ticket
            served = True
        finally:
            self._leave(ticket)
            if served:
                self.waits.append(time.monotonic() - ticket.entered)

    def _leave(self, ticket: Ticket) -> None:
        was_head = bool(self._tickets) and self._tickets[0] is ticket
        try:
            self._tickets.remove(ticket)
        except ValueError:
            return
        if was_head and self._tickets:
            self._tickets[0].turn.set()  # the next one retries at once: room may remain

    async def wait_turn(self, ticket: Ticket) -> None:
        """Until the ticket is at the head of the queue (raises QueueTimeout)."""
        try:
            await asyncio.wait_for(ticket.turn.wait(), max(0.0, self._left(ticket)))
        except asyncio.TimeoutError:
            raise self._timed_out() from None

    async def wait_retry(self, ticket: Ticket, retry_after_s: float) -> None:
        """The head, refused again: wait for a freed request or its Retry-After."""
        left = self._left(ticket)
        if left <= 0:
            raise self._timed_out()
        self._freed.clear()
        try:
            await asyncio.wait_for(self._freed.wait(),
                                   min(max(retry_after_s, 0.05), MAX_RETRY_WAIT_S, left))
        except asyncio.TimeoutError:
            pass

    def _left(self, ticket: Ticket) -> float:
        return self.max_wait_s - (time.monotonic() - ticket.entered)

    def _timed_out(self) -> QueueTimeout:
        self.total_timed_out += 1
        return QueueTimeout(f"no replica had room within {self.max_wait_s:g} s")

    def summary(self) -> dict:
        waits = sorted(self.waits)
        return {"queued": len(self._tickets), "capacity": self.capacity,
                "max_wait_s": self.max_wait_s, "total_queued": self.total_queued,
                "total_timed_out": self.total_timed_out,
                "total_rejected_full": self.total_rejected_full,
                "wait_p50_s": waits[len(waits) // 2] if waits else None,
                "wait_max_s": waits[-1] if waits else None}
