"""Load accounting per replica: what this gateway booked, reconciled with what the engine reports.

A gateway's own bookings are exact but partial (other gateways route too); the engine's report
covers every gateway but lags. The effective load is the engine's report plus whatever this
gateway booked after that report arrived, and never less than this gateway's own open bookings.

Priority (lower is more urgent): a request of priority p competes only with work of priority
<= p, since the engine serves that first and preempts the rest for it. So a view for p counts
only bookings and engine-reported work of priority <= p; an engine that reports no breakdown
by priority has all of its work counted.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class Booking:
    replica: str
    prefill_tokens: int
    reserved_at: float
    prefilling: bool = True
    priority: int = 0

    def competes_with(self, priority: int | None) -> bool:
        return priority is None or self.priority <= priority


@dataclass(slots=True)
class EngineLoad:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    pending_prefill_tokens: int = 0
    received_at: float = 0.0
    by_priority: dict[int, tuple[int, int, int]] | None = None  # (running, waiting, pending)
    queue_delay_s: float = 0.0  # the engine's estimate of a new request's wait, when reported
    max_queue_delay_s: float = 0.0  # its admission bound: it refuses past it (0: never)
    drain_rate_tok_s: float = 0.0  # prefill tokens per second its queue is retired at

    def upto(self, priority: int | None) -> tuple[int, int, int]:
        """(running, waiting, pending prefill tokens) of priority <= `priority` (None: all)."""
        if priority is None or self.by_priority is None:
            return self.running, self.waiting, self.pending_prefill_tokens
        rows = [row for p, row in self.by_priority.items() if p <= priority]
        return (sum(r[0] for r in rows), sum(r[1] for r in rows), sum(r[2] for r in rows))


@dataclass(slots=True)
class LoadView:
    """The load a policy sees for one replica."""

    in_flight: int = 0
    pending_prefill_tokens: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


@dataclass(slots=True)
class _ReplicaLoad:
    bookings: OrderedDict[str, Booking] = field(default_factory=OrderedDict)  # by reserve time
    pending_prefill_tokens: int = 0
    engine: EngineLoad | None = None
    by_priority: dict[int, list[int]] = field(default_factory=dict)  # p -> [in flight, pending]
    restore_cost: float | None = None  # its KV tier's restore time per token / prefill time

    def own(self, priority: int | None) -> tuple[int, int]:
        """This gateway's open bookings of priority <= `priority` (None: all), and their
        pending prefill tokens."""
        if priority is None:
            return len(self.bookings), self.pending_prefill_tokens
        rows = [row for p, row in self.by_priority.items() if p <= priority]
        return sum(r[0] for r in rows), sum(r[1] for r in rows)

    def count(self, booking: Booking, in_flight: int, pending: int) -> None:
        row = self.by_priority.setdefault(booking.priority, [0, 0])
        row[0] += in_flight
        row[1] += pending
        self.pending_prefill_tokens += pending
        if row == [0, 0]:
            del self.by_priority[booking.priority]


class LoadTracker:
    def __init__(
        self, engine_stale_after_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.engine_stale_after_s = engine_stale_after_s
        self.clock = clock
        self._replicas: dict[str, _ReplicaLoad] = {}
        self._bookings: dict[str, Booking] = {}

    def add_replica(self, name: str) -> None:
        self._replicas.setdefault(name, _ReplicaLoad())

    def remove_replica(self, name: str) -> None:
        load = self._replicas.pop(name, None)
        if load is not None:
            for request_id in load.bookings:
                self._bookings.pop(request_id, None)

    def reserve(self, request_id: str, replica: str, prefill_tokens: int,
                priority: int = 0) -> None:
        """Book a routed request: one more in flight, its uncached tokens still to prefill."""
        if request_id in self._bookings:
            raise ValueError(f"request {request_id!r} is already booked")
        load = self._replicas[replica]
        booking = Booking(replica, max(0, int(prefill_tokens)), self.clock(), priority=priority)
        load.bookings[request_id] = booking
        load.count(booking, 1, booking.prefill_tokens)
        self._bookings[request_id] = booking

    def first_token(self, request_id: str) -> None:
        """Prefill is done: the request no longer adds prefill work."""
        booking = self._bookings.get(request_id)
        if booking is not None and booking.prefilling:
            booking.prefilling = False
            self._replicas[booking.replica].count(booking, 0, -booking.prefill_tokens)

    def finish(self, request_id: str) -> None:
        """Release a booking (completion, error or client abort); unknown ids are ignored."""
        booking = self._bookings.pop(request_id, None)
        if booking is None:
            return
        load = self._replicas.get(booking.replica)
        if load is None:
            return
        load.count(booking, -1, -booking.prefill_tokens if booking.prefilling else 0)
        load.bookings.pop(request_id, None)

    def observe_engine(self, replica: str, report: Mapping | None) -> None:
        """Record the load an engine reported (snapshot, event or heartbeat)."""
        load = self._replicas.get(replica)
        if load is None or report is None:
            return
        tier = report.get("kv_tier")
        if isinstance(tier, Mapping) and "restore_cost" in tier:
            load.restore_cost = min(1.0, max(0.0, float(tier["restore_cost"])))
        load.engine = EngineLoad(
            running=int(report.get("running", 0)),
            waiting=int(report.get("waiting", 0)),
            kv_usage=float(report.get("kv_usage", 0.0)),
            pending_prefill_tokens=int(report.get("pending_prefill_tokens", 0)),
            received_at=self.clock(),
            by_priority=_by_priority(report.get("by_priority")),
            queue_delay_s=float(report.get("queue_delay_s") or 0.0),
            max_queue_delay_s=float(report.get("max_queue_delay_s") or 0.0),
            drain_rate_tok_s=float(report.get("drain_rate_tok_s") or 0.0),
        )

    def view(self, replica: str, priority: int | None = None) -> LoadView:
        """The load a request of `priority` competes with (None: all of it)."""
        load = self._replicas[replica]
        own_in_flight, own_pending = load.own(priority)
        engine = load.engine
        if engine is None or self.clock() - engine.received_at > self.engine_stale_after_s:
            return LoadView(own_in_flight, own_pending, 0, 0.0 if engine is None else engine.kv_usage)
        newer, newer_pending = _newer(load, engine, priority)
        running, waiting, pending = engine.upto(priority)
        return LoadView(
            in_flight=max(own_in_flight, running + waiting + newer),
            pending_prefill_tokens=max(own_pending, pending + newer_pending),
            waiting=waiting,
            kv_usage=engine.kv_usage,
        )

    def over_admission_bound(self, replica: str, prompt_tokens: int,
                             request_id: str | None = None) -> float | None:
        """Would the replica refuse a request of `prompt_tokens` now (its wait for a first
        token over the engine's admission bound)? The seconds over the bound if so, by the
        engine's own estimate plus what this gateway booked there since its report (but the
        request's own booking, `request_id`); None when it would take it, reports no bound,
        or its report is stale."""
        load, engine = self._replicas.get(replica), self.engine_report(replica)
        if load is None or engine is None or engine.max_queue_delay_s <= 0:
            return None
        newer, newer_pending = _newer(load, engine, None)
        others = len(load.bookings)
        own = load.bookings.get(request_id) if request_id is not None else None
        if own is not None:
            others -= 1
            if own.reserved_at > engine.received_at:
                newer -= 1
                newer_pending -= own.prefill_tokens if own.prefilling else 0
        if engine.running + engine.waiting + newer + others == 0:
            return None  # an idle replica takes the request at once
        rate = engine.drain_rate_tok_s
        delay = (engine.queue_delay_s + (newer_pending + prompt_tokens) / rate if rate > 0
                 else float("inf"))
        over = delay - engine.max_queue_delay_s
        return min(over, 30.0) if over > 0 else None

    def restore_cost(self, replica: str) -> float | None:
        """The replica's measured KV-tier restore cost per token, as a share of prefilling it."""
        load = self._replicas.get(replica)
        return None if load is None else load.restore_cost

    def engine_report(self, replica: str) -> EngineLoad | None:
        """The engine's last load report, if fresh."""
        load = self._replicas.get(replica)
        if load is None or load.engine is None:
            return None
        if self.clock() - load.engine.received_at > self.engine_stale_after_s:
            return None
        return load.engine

    def engine_counts(self, replica: str, priority: int | None = None) -> tuple[int, int]:
        """The fresh engine report's (running + waiting, pending prefill tokens) of priority
        <= `priority`; (0, 0) without a fresh report."""
        engine = self.engine_report(replica)
        if engine is None:
            return 0, 0
        running, waiting, pending = engine.upto(priority)
        return running + waiting, pending

    def booking(self, request_id: str) -> Booking | None:
        return self._bookings.get(request_id)

    def in_flight_by_priority(self) -> dict[int, int]:
        """This gateway's open bookings by priority, over all replicas."""
        out: dict[int, int] = {}
        for load in self._replicas.values():
            for priority, (in_flight, _) in load.by_priority.items():
                out[priority] = out.get(priority, 0) + in_flight
        return out


def _newer(load: _ReplicaLoad, engine: EngineLoad, priority: int | None) -> tuple[int, int]:
    """This gateway's bookings made after the engine's report (so not in it) that compete
    with `priority`, and their prefill tokens still to do."""
    newer, pending = 0, 0
    for booking in reversed(load.bookings.values()):
        if booking.reserved_at <= engine.received_at:
            break  # bookings are in reserve order; older ones are in the engine's report
        if booking.competes_with(priority):
            newer += 1
            if booking.prefilling:
                pending += booking.prefill_tokens
    return newer, pending


def _by_priority(raw: object) -> dict[int, tuple[int, int, int]] | None:
    """An engine's {"<priority>": {running, waiting, pending_prefill_tokens}}; None when absent
    or malformed (then all of the engine's work counts for every request)."""
    if not isinstance(raw, Mapping):
        return None
    try:
        return {int(p): (int(row.get("running", 0)), int(row.get("waiting", 0)),
                         int(row.get("pending_prefill_tokens", 0)))
                for p, row in raw.items()}
    except (TypeError, ValueError, AttributeError):
        return None
