"""Passive outlier detection: a circuit breaker per replica. Consecutive failures open it; after
a cooldown one trial request (or a passing health check) half-opens it; a success closes it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_CODES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


@dataclass(slots=True)
class CircuitBreaker:
    failure_threshold: int = 3
    cooldown_s: float = 5.0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    state: str = CLOSED
    consecutive_failures: int = 0
    opened_at: float = 0.0
    trial_in_flight: bool = False
    times_opened: int = 0

    def allow(self) -> bool:
        """May a new request go to this replica now?"""
        if self.state == CLOSED:
            return True
        if self.state == OPEN and self.clock() - self.opened_at >= self.cooldown_s:
            self.state = HALF_OPEN
            self.trial_in_flight = False
        return self.state == HALF_OPEN and not self.trial_in_flight

    def on_dispatch(self) -> None:
        if self.state == HALF_OPEN:
            self.trial_in_flight = True

    def record_success(self) -> None:
        self.state = CLOSED
        self.consecutive_failures = 0
        self.trial_in_flight = False

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        self.trial_in_flight = False
        if self.state == HALF_OPEN or self.consecutive_failures >= self.failure_threshold:
            self.trip()

    def trip(self) -> None:
        if self.state != OPEN:
            self.times_opened += 1
        self.state = OPEN
        self.opened_at = self.clock()
