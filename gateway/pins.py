"""The gateway's pinned prefixes: what an admin pinned, per model, kept in Redis when configured
(hash `kvgate:pins`, so every gateway pushes the same pins) and in memory otherwise. If Redis
fails, the last list read is served and writes are refused: a pin must not exist on one
gateway only."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field

from redis.exceptions import RedisError

from protocol.errors import service_unavailable

log = logging.getLogger(__name__)
REDIS_PINS_HASH = "kvgate:pins"
GATEWAY_PIN_PREFIX = "gw-"  # pin ids the gateway owns on replicas (it may remove stale ones)


@dataclass(slots=True)
class PinRecord:
    pin_id: str
    model: str
    prefix: dict  # the replica body's prefix fields: prompt | token_ids | messages (+ kwargs, salt)
    excerpt: str
    created: float = field(default_factory=time.time)

    def replica_body(self) -> dict:
        return {"model": self.model, "id": self.pin_id, **self.prefix}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> "PinRecord":
        return cls(**json.loads(raw))


class PinStore:
    def __init__(self, redis=None) -> None:  # noqa: ANN001 - redis.asyncio client or None
        self.redis = redis
        self._local: dict[str, PinRecord] = {}
        self.redis_ok = True

    async def all(self) -> list[PinRecord]:
        if self.redis is not None:
            try:
                raw = await self.redis.hgetall(REDIS_PINS_HASH)
            except (RedisError, OSError) as exc:
                if self.redis_ok:
                    log.warning("pins: Redis unavailable (%s); serving the last list read", exc)
                self.redis_ok = False
            else:
                self.redis_ok = True
                self._local = {pin_id: PinRecord.from_json(v) for pin_id, v in raw.items()}
        return sorted(self._local.values(), key=lambda r: r.created)

    async def get(self, pin_id: str) -> PinRecord | None:
        return next((r for r in await self.all() if r.pin_id == pin_id), None)

    async def put(self, record: PinRecord) -> None:
        if self.redis is not None:
            try:
                await self.redis.hset(REDIS_PINS_HASH, record.pin_id, record.to_json())
            except (RedisError, OSError) as exc:
                raise service_unavailable(f"Pins live in Redis, which is unavailable: {exc}",
                                          5, "redis_unavailable") from None
        self._local[record.pin_id] = record

    async def delete(self, pin_id: str) -> bool:
        if self.redis is not None:
            try:
                removed = bool(await self.redis.hdel(REDIS_PINS_HASH, pin_id))
            except (RedisError, OSError) as exc:
                raise service_unavailable(f"Pins live in Redis, which is unavailable: {exc}",
                                          5, "redis_unavailable") from None
            self._local.pop(pin_id, None)
            return removed
        return self._local.pop(pin_id, None) is not None

    @property
    def count(self) -> int:
        """Pins as of the last read (for metrics, which cannot wait on Redis)."""
        return len(self._local)
