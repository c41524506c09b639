"""Per-key request and token rate limits (per minute): counted in Redis when the store is
shared, so all gateways enforce one budget; in memory when Redis is absent or down."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from routing.redis_store import RedisStore


@dataclass(slots=True)
class RateLimit:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


@dataclass(slots=True)
class RateDecision:
    allowed: bool
    requests: int  # counted in the current window, this request included
    tokens: int
    shared: bool  # counted in Redis (all gateways) rather than locally
    retry_after_s: float = 0.0


class RateLimiter:
    def __init__(self, store: RedisStore | None = None, window_s: float = 60.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.window_s = window_s
        self.clock = clock
        self._local: dict[tuple[str, int], list[int]] = {}

    async def check(self, key: str, tokens: int, limit: RateLimit) -> RateDecision:
        """Count a request of `tokens` for `key` and say whether it fits the limit."""
        counted = None
        if self.store is not None:
            counted = await self.store.count_usage(key, tokens, self.window_s)
        shared = counted is not None
        if counted is None:
            counted = self._count_locally(key, tokens)
        requests, used = counted
        over = ((limit.requests_per_minute is not None and requests > limit.requests_per_minute)
                or (limit.tokens_per_minute is not None and used > limit.tokens_per_minute))
        retry = self.window_s - (self.clock() % self.window_s) if over else 0.0
        return RateDecision(not over, requests, used, shared, retry)

    def _count_locally(self, key: str, tokens: int) -> tuple[int, int]:
        bucket = int(self.clock() // self.window_s)
        for old in [k for k in self._local if k[1] < bucket]:
            del self._local[old]
        counts = self._local.setdefault((key, bucket), [0, 0])
        counts[0] += 1
        counts[1] += tokens
        return counts[0], counts[1]
