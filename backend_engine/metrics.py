"""Counters and latency observations collected in the engine; the server exports them."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # prompt tokens found there
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_by_reason: Counter = field(default_factory=Counter)
    admission_refused: int = 0  # requests refused because the queue could not meet its bound
    _observations: dict[str, list[float]] = field(
        default_factory=lambda: {"ttft": [], "tpot": [], "e2e": [], "queue": [], "step": [],
                                 "grammar_compile": [], "grammar_mask": [],
                                 "kv_tier_restore": []})
    _ttft_by_priority: list[tuple[int, float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            values = self._observations[name]
            if len(values) < 100_000:  # bounded if nobody drains
                values.append(seconds)

    def observe_ttft_by_priority(self, priority: int, seconds: float) -> None:
        with self._lock:
            if len(self._ttft_by_priority) < 100_000:
                self._ttft_by_priority.append((priority, seconds))

    def drain_observations(self) -> dict[str, list[float]]:
        with self._lock:
            out = self._observations
            self._observations = {k: [] for k in out}
        return out

    def drain_ttft_by_priority(self) -> list[tuple[int, float]]:
        with self._lock:
            out, self._ttft_by_priority = self._ttft_by_priority, []
        return out
