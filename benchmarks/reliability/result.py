"""What one scenario reports: requests sent, succeeded, failed (an OpenAI error), lost (neither),
and the named checks that decide whether it passed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from benchmarks.reliability.load import ERROR, LOST, OK, Tally


@dataclass(slots=True)
class ScenarioResult:
    name: str
    sent: int = 0
    succeeded: int = 0
    failed: int = 0
    lost: int = 0
    checks: dict[str, bool] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    rss_growth_mb: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.lost == 0 and all(self.checks.values())

    def count(self, tally: Tally) -> "ScenarioResult":
        self.sent += tally.sent
        self.succeeded += tally.count(OK)
        self.failed += tally.count(ERROR)
        self.lost += tally.count(LOST)
        lost = [o.detail for o in tally.outcomes if o.kind == LOST]
        if lost:
            self.notes.setdefault("lost", []).extend(lost[:5])
        return self

    def failed_checks(self) -> list[str]:
        return [name for name, ok in self.checks.items() if not ok]
