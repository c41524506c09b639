"""When to speculate. Drafts cost compute: verifying k extra tokens per sequence is nearly free
while a CPU or GPU step is bound by reading the weights (small batches), and a loss once the
step becomes compute-bound (vLLM has seen 1.8x slowdowns at high load). So speculation is off
for large batches, and off for a sequence while its recent drafts are mostly rejected, with a
periodic probe to notice when they start paying again. A verification step of 1 + k tokens costs
more than a plain decode step, so drafts pay only when enough of them are accepted; 0.4 is the
default bar."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class SpecStats:
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # tokens appended by verification steps (accepted + bonus)
    verifications: int = 0  # sequence-steps that verified drafts

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.accepted_tokens / self.verifications if self.verifications else 0.0


class SpecController:
    def __init__(self, max_batch: int = 4, min_acceptance: float = 0.4,
                 probe_every: int = 16, smoothing: float = 0.3, initial_acceptance: float = 0.5):
        self.max_batch = max_batch
        self.min_acceptance = min_acceptance
        self.probe_every = probe_every
        self.smoothing = smoothing
        self.initial_acceptance = initial_acceptance  # just above the bar: one miss turns it off
        self.stats = SpecStats()
        self._acceptance: dict[str, float] = {}  # seq id → recent acceptance
        self._skipped: dict[str, int] = {}

    def should_speculate(self, num_running: int) -> bool:
        """The batch-level switch, asked once per step."""
        return num_running <= self.max_batch

    def draft_budget(self, seq_id: str, k: int) -> int:
        """How many tokens this sequence should draft now: none while its drafts keep failing
        (a probe of one token every probe_every steps), else k scaled by its recent acceptance,
        so an uncertain sequence risks a cheap verification, not an expensive one."""
        acceptance = self._acceptance.get(seq_id, self.initial_acceptance)
        if acceptance < self.min_acceptance:
            skipped = self._skipped.get(seq_id, 0) + 1
            self._skipped[seq_id] = 0 if skipped >= self.probe_every else skipped
            return 1 if skipped >= self.probe_every else 0
        return max(1, min(k, math.ceil(k * acceptance * 1.25)))

    def record(self, seq_id: str, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        s = self.stats
        s.drafted_tokens += drafted
        s.accepted_tokens += accepted
        s.emitted_tokens += accepted + 1
        s.verifications += 1
        a = self.smoothing
        prev = self._acceptance.get(seq_id, self.initial_acceptance)
        self._acceptance[seq_id] = (1 - a) * prev + a * (accepted / drafted)

    def forget(self, seq_id: str) -> None:
        self._acceptance.pop(seq_id, None)
        self._skipped.pop(seq_id, None)
