"""Requests every replica refused for load (503 `engine_overloaded` + Retry-After) wait here,
first come first served, instead of failing: the head retries routing when a request finishes
somewhere or its Retry-After passes, the others wait their turn, and a request that arrives
while the queue is not empty joins its end rather than overtaking it. Bounded in length and in
wait; past either bound the client gets the 503 itself.

The line is for requests waiting for room, not for answers: once the head is sent to a replica
that is expected to admit it (the gateway's estimate from the replica's load report), the next
request takes its turn at once, without waiting for the first's answer, which from a kvgate
replica comes with its first token. If the replica refuses after all, the request goes back to
its place in line.

Affinity survives the queue: a released request whose prefix-preferred replica (the policy's
pick, holding its longest cached prefix) refuses again holds on to that replica for up to
`affinity_s` - it is woken when that replica frees and routed again by the policy, which still
weighs load (its window) - and steps out of line meanwhile, so the requests behind it take the
replicas that free elsewhere. Only past `affinity_s` does it take whichever replica has room."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

MAX_RETRY_WAIT_S = 1.0  # the head re-checks at least this often, whatever Retry-After said


class QueueFull(Exception):
    """The overload queue is at capacity."""

    retry_after_s = 1.0  # the last refusal's, for the client's Retry-After


class QueueTimeout(Exception):
    """A request waited its maximum and no replica took it."""

    retry_after_s = 1.0


@dataclass(slots=True)
class Overloaded:
    """Every replica that could take the request refused it for load (or, for a queued request
    that may hold on to its prefix, the replica holding the prefix did: `preferred`)."""
    retry_after_s: float
    preferred: str | None = None


T = TypeVar("T")


@dataclass(eq=False)
class Ticket:
    request_id: str
    entered: float = field(default_factory=time.monotonic)
    turn: asyncio.Event = field(default_factory=asyncio.Event)  # set when it may try again
    preferred: str | None = None  # the replica it holds on to (its prefix is cached there)
    affinity_until: float = 0.0
    dispatched: bool = False  # sent to a replica expected to admit it: out of the line's way

    def holds_affinity(self, now: float | None = None) -> bool:
        return self.preferred is not None and (now or time.monotonic()) < self.affinity_until


class OverloadQueue:
    def __init__(self, capacity: int, max_wait_s: float, affinity_s: float = 0.0):
        self.capacity = capacity
        self.max_wait_s = max_wait_s
        self.affinity_s = affinity_s
        self._tickets: deque[Ticket] = deque()
        self._freed = asyncio.Event()  # a request finished on some replica
        self.total_queued = 0
        self.total_timed_out = 0
        self.total_rejected_full = 0
        self.total_affinity_held = 0  # released tickets that waited for their preferred replica
        self.waits: deque[float] = deque(maxlen=512)  # seconds, of requests that left it served

    def __len__(self) -> int:
        return len(self._tickets)

    def notify_freed(self, replica: str | None = None) -> None:
        """A request finished on `replica`: the oldest request holding on to it tries it, or
        else the head of the line may find room now."""
        if replica is not None:
            now = time.monotonic()
            holder = next((t for t in self._tickets
                           if t.preferred == replica and t.holds_affinity(now)), None)
            if holder is not None:
                holder.turn.set()
                return
        self._freed.set()

    def may_hold(self, ticket: Ticket) -> bool:
        """May this ticket still wait for its prefix's replica rather than take any?"""
        return self.affinity_s > 0 and (ticket.preferred is None or ticket.holds_affinity())

    def hold(self, ticket: Ticket, replica: str) -> None:
        """The ticket waits for `replica` (for `affinity_s` from its first hold) and leaves its
        place at the head of the line to the next request."""
        if ticket.preferred is None:
            ticket.affinity_until = time.monotonic() + self.affinity_s
            self.total_affinity_held += 1
        ticket.preferred = replica
        head = self._head()
        if head is not None:
            head.turn.set()

    def _head(self) -> Ticket | None:
        """The first ticket not holding on to a replica nor sent to one: the one that retries
        for any room."""
        now = time.monotonic()
        return next((t for t in self._tickets
                     if not t.dispatched and not t.holds_affinity(now)), None)

    def dispatched(self, ticket: Ticket) -> None:
        """The ticket's request was sent to a replica expected to admit it: the next request
        takes its turn now."""
        ticket.dispatched = True
        head = self._head()
        if head is not None:
            head.turn.set()

    @asynccontextmanager
    async def holding(self, request_id: str):
        """A place in the queue for the duration of the block (raises QueueFull)."""
        if len(self._tickets) >= self.capacity:
            self.total_rejected_full += 1
            raise QueueFull(f"{len(self._tickets)} requests are already waiting for a replica")
        ticket = Ticket(request_id)
        self._tickets.append(ticket)
        self.total_queued += 1
        if self._head() is ticket:
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
        was_head = self._head() is ticket
        try:
            self._tickets.remove(ticket)
        except ValueError:
            return
        head = self._head()
        if was_head and head is not None:
            head.turn.set()  # the next one retries at once: room may remain

    async def serve(self, request_id: str,
                    attempt: Callable[[bool, Callable[[], None]], Awaitable[T | Overloaded]],
                    refusal: Overloaded | None = None) -> T:
        """Wait in line, in arrival order, and at the head call `attempt(hold, dispatched)` (one
        pass over the replicas; `hold`: it may keep to its prefix's replica; `dispatched()`: the
        pass sent the request where it expects it to be admitted) until it is not refused.
        `refusal`: the pass that already failed before the request joined. Raises QueueFull or
        QueueTimeout, carrying the last refusal's Retry-After."""
        try:
            async with self.holding(request_id) as ticket:
                if not ticket.turn.is_set():  # not the head on joining: it waits its turn, ...
                    await self.wait_turn(ticket)
                    refusal = None  # ... which the one before passes on: room may remain
                while True:
                    if refusal is not None:
                        await self.wait_retry(ticket, refusal.retry_after_s)
                    outcome = await attempt(self.may_hold(ticket),
                                            lambda: self.dispatched(ticket))
                    if not isinstance(outcome, Overloaded):
                        return outcome
                    refusal = outcome
                    ticket.dispatched = False  # refused after all: back in its place in line
                    if outcome.preferred is not None:
                        self.hold(ticket, outcome.preferred)
                    elif not ticket.holds_affinity() and self._head() is not ticket:
                        # a request ahead of it retries for room; its turn comes after that one's
                        # (one still holding on to a replica goes on holding: nobody would give
                        # it a turn when its hold ends, and the line would wait for it)
                        ticket.turn.clear()
                        await self.wait_turn(ticket)
                        refusal = None  # room may remain: try at once
        except (QueueFull, QueueTimeout) as exc:
            exc.retry_after_s = refusal.retry_after_s if refusal is not None else 1.0
            raise

    async def wait_turn(self, ticket: Ticket) -> None:
        """Until the ticket is at the head of the queue (raises QueueTimeout)."""
        try:
            await asyncio.wait_for(ticket.turn.wait(), max(0.0, self._left(ticket)))
        except asyncio.TimeoutError:
            raise self._timed_out() from None

    async def wait_retry(self, ticket: Ticket, retry_after_s: float) -> None:
        """Refused again: wait for its replica to free (while it holds on to one), else for any
        freed request or its Retry-After."""
        left = self._left(ticket)
        if left <= 0:
            raise self._timed_out()
        if ticket.holds_affinity():
            try:  # a wake-up that came during the last try counts: its replica freed since
                await asyncio.wait_for(ticket.turn.wait(),
                                       min(ticket.affinity_until - time.monotonic(), left))
            except asyncio.TimeoutError:
                pass  # held long enough: from now on any replica with room will do
            ticket.turn.clear()
            return
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
                "total_affinity_held": self.total_affinity_held, "affinity_s": self.affinity_s,
                "wait_p50_s": waits[len(waits) // 2] if waits else None,
                "wait_max_s": waits[-1] if waits else None}
