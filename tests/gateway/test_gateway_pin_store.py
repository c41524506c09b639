"""The gateway's pin store: in memory, or in Redis so every gateway sees the same pins; with
Redis down the last list read is served and writes are refused (503), never split."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from gateway.pins import PinRecord, PinStore
from protocol.errors import APIError
from tests.routing.conftest import redis_server  # noqa: F401 - fixture

RECORD = PinRecord("gw-1", "tiny-random", {"prompt": "You are ACME's assistant."}, "You are ACME's…")


async def test_memory_store_keeps_pins_in_creation_order():
    store = PinStore()
    second = PinRecord("gw-2", "m", {"token_ids": [1] * 16}, "[16 token ids]", created=RECORD.created + 1)
    await store.put(second)
    await store.put(RECORD)
    assert [r.pin_id for r in await store.all()] == ["gw-1", "gw-2"]
    assert await store.delete("gw-1") and not await store.delete("gw-1")
    assert store.count == 1


async def test_two_gateways_sharing_redis_see_the_same_pins(redis_server):  # noqa: F811
    clients = [aioredis.Redis.from_url(redis_server.url, decode_responses=True) for _ in range(2)]
    a, b = (PinStore(c) for c in clients)
    try:
        await a.put(RECORD)
        assert await b.all() == [RECORD]
        assert await b.delete("gw-1")
        assert await a.all() == [] and a.count == 0
    finally:
        for c in clients:
            await c.aclose()


async def test_with_redis_down_reads_serve_the_last_list_and_writes_are_refused(redis_server):  # noqa: F811
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True, socket_timeout=0.5)
    store = PinStore(client)
    try:
        await store.put(RECORD)
        assert await store.all() == [RECORD]
        redis_server.stop()
        assert await store.all() == [RECORD] and not store.redis_ok
        with pytest.raises(APIError) as info:
            await store.put(PinRecord("gw-2", "m", {"prompt": "x" * 40}, "x"))
        assert info.value.status_code == 503 and info.value.code == "redis_unavailable"
        assert [r.pin_id for r in await store.all()] == ["gw-1"]
    finally:
        await client.aclose()
