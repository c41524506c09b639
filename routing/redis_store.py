"""Shared routing state in Redis (redis-py asyncio): atomic route-and-reserve with per-request
leases, predicted entries shared by every gateway, and rate-limit counters.

Every call is bounded by `timeout_s`. A failure or a timeout flips the store to
`local_fallback`: callers get None and route on local state within the same request; after
`retry_after_s` the next call tries Redis again and, if it answers, the store is `shared` again.
The exact index never needs Redis: every gateway consumes every replica's event stream.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import struct
import sys
import time
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from routing.policies.prefix_cost import UNCACHED_WEIGHT
from routing.redis_lua import COUNT_USAGE, ROUTE_AND_RESERVE

log = logging.getLogger(__name__)
T = TypeVar("T")
_LITTLE_ENDIAN = sys.byteorder == "little" and array("Q").itemsize == 8


class StoreState(str, enum.Enum):
    DISABLED = "disabled"  # no Redis URL configured: local state only, by design
    SHARED = "shared"  # Redis answers: state shared by all gateways
    LOCAL_FALLBACK = "local_fallback"  # Redis down or slow: routing on local state


@dataclass(slots=True)
class Candidate:
    """One replica offered to the shared route-and-reserve, with what this gateway knows."""

    name: str
    cached_tokens: int = 0  # from this gateway's exact index (and local predictions)
    max_in_flight: int = 0  # booking capacity; 0 = unlimited
    saturated: bool = False  # a guard (KV usage, queue) excludes it while others remain
    engine_in_flight: int = 0  # engine-reported running + waiting (of priority <= the
    engine_pending_prefill: int = 0  # request's): a floor for the shared count
    hint: int = 0  # rendezvous weight + 1 for the request's routing hint; 0: no hint


@dataclass(slots=True)
class SharedScore:
    replica: str
    cached_tokens: int
    in_flight: int
    pending_prefill_tokens: int
    cost: float


@dataclass(slots=True)
class SharedPick:
    replica: str | None  # None: every replica at capacity
    reason: str
    scores: list[SharedScore]


@dataclass(slots=True)
class CostParams:
    window_abs: float = 4
    window_rel: float = 0.25
    uncached_weight: float = UNCACHED_WEIGHT
    batch_scale: float = 4.0
    near_equal: float = 0.05


class RedisStore:
    def __init__(
        self,
        url: str,
        prefix: str = "kvgate",
        timeout_s: float = 0.05,
        retry_after_s: float = 1.0,
        lease_s: float = 300.0,
        predicted_ttl_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefix = "{" + prefix + "}"  # one hash slot, so the script's keys stay together
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.lease_ms = int(lease_s * 1000)
        self.predicted_ttl_ms = int(predicted_ttl_s * 1000)
        self.clock = clock
        self.client = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), decode_responses=True)
        self._route = self.client.register_script(ROUTE_AND_RESERVE)
        self._count = self.client.register_script(COUNT_USAGE)
        self.state = StoreState.SHARED
        self.failures = 0
        self._retry_at = 0.0

    # -- failure handling -----------------------------------------------------------------
    async def _call(self, make: Callable[[], Awaitable[T]]) -> T | None:
        if self.state is StoreState.LOCAL_FALLBACK and self.clock() < self._retry_at:
            return None
        try:
            result = await asyncio.wait_for(make(), self.timeout_s)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self.failures += 1
            if self.state is not StoreState.LOCAL_FALLBACK:
                log.warning("redis unavailable (%s): routing on local state", exc)
            self.state = StoreState.LOCAL_FALLBACK
            self._retry_at = self.clock() + self.retry_after_s
            await self._reset_connections()
            return None
        if self.state is StoreState.LOCAL_FALLBACK:
            log.warning("redis is back: routing state shared again")
        self.state = StoreState.SHARED
        return result

    async def _reset_connections(self) -> None:
        # A timed-out command leaves its connection mid-reply; never reuse it.
        try:
            await self.client.connection_pool.disconnect()
        except Exception:  # noqa: BLE001 - best effort on an already broken pool
            pass

    def _key(self, kind: str, replica: str) -> str:
        return f"{self.prefix}:{kind}:{replica}"

    # -- routing --------------------------------------------------------------------------
    async def route_and_reserve(
        self, request_id: str, candidates: Sequence[Candidate], hashes: Sequence[int],
        prompt_tokens: int, block_size: int, rand: float, params: CostParams | None = None,
        priority: int = 0,
    ) -> SharedPick | None:
        """Pick a replica and book it in one atomic script; None if Redis failed. Load counts
        only leases of priority <= `priority` (lower is more urgent)."""
        p = params or CostParams()
        keys: list[str] = []
        args: list[object] = [
            int(time.time() * 1000), self.lease_ms, self.predicted_ttl_ms, request_id,
            prompt_tokens, block_size, rand, p.window_abs, p.window_rel, p.uncached_weight,
            p.batch_scale, p.near_equal, len(candidates), int(priority)]
        for c in candidates:
            keys += [self._key("lease", c.name), self._key("pending", c.name),
                     self._key("pred", c.name), self._key("prio", c.name)]
            args += [c.name, c.cached_tokens, c.max_in_flight, int(c.saturated),
                     c.engine_in_flight, c.engine_pending_prefill, c.hint]
        keys.append(f"{self.prefix}:newprefix")
        args.append(array("Q", hashes).tobytes() if _LITTLE_ENDIAN else
                    b"".join(struct.pack("<Q", h) for h in hashes))
        raw = await self._call(lambda: self._route(keys=keys, args=args))
        if raw is None:
            return None
        chosen, reason, rows = json.loads(raw)
        scores = [SharedScore(name, int(cached), int(in_flight), int(pending), float(cost))
                  for name, cached, in_flight, pending, cost in rows]
        return SharedPick(chosen or None, reason, scores)

    async def first_token(self, replica: str, request_id: str) -> bool:
        """The request's prefill is done: drop its pending prefill tokens."""
        done = await self._call(lambda: self.client.hdel(self._key("pending", replica), request_id))
        return done is not None

    async def finish(self, replica: str, request_id: str) -> bool:
        """Release the request's lease."""
        async def release() -> list:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.zrem(self._key("lease", replica), request_id)
                pipe.hdel(self._key("pending", replica), request_id)
                pipe.hdel(self._key("prio", replica), request_id)
                return await pipe.execute()
        return await self._call(release) is not None

    async def renew(self, replica: str, request_id: str) -> bool:
        """Extend a long-running request's lease (a gateway heartbeats while it streams)."""
        expiry = int(time.time() * 1000) + self.lease_ms
        done = await self._call(lambda: self.client.zadd(
            self._key("lease", replica), {request_id: expiry}, xx=True))
        return done is not None

    async def in_flight(self, replica: str) -> int | None:
        """Live leases of a replica (expired ones excluded), for metrics and tests."""
        now = int(time.time() * 1000)
        return await self._call(lambda: self.client.zcount(
            self._key("lease", replica), f"({now}", "+inf"))

    # -- rate limits ----------------------------------------------------------------------
    async def count_usage(self, key: str, tokens: int,
                          window_s: float = 60.0) -> tuple[int, int] | None:
        """Count one request and `tokens` for `key` in the current window; returns the
        window's (requests, tokens) so far, or None if Redis failed."""
        window_ms = int(window_s * 1000)
        bucket = int(time.time() * 1000) // window_ms
        keys = [f"{self.prefix}:rl:{key}:{bucket}:req", f"{self.prefix}:rl:{key}:{bucket}:tok"]
        raw = await self._call(lambda: self._count(keys=keys, args=[int(tokens), window_ms]))
        return None if raw is None else (int(raw[0]), int(raw[1]))

    async def ping(self) -> bool:
        return await self._call(self.client.ping) is not None

    async def close(self) -> None:
        await self.client.aclose()
