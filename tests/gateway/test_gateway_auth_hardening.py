"""Key checks that hold under attack: constant work per presented key, and a bounded cache of
Redis answers however many wrong keys a client invents."""

from __future__ import annotations

import hmac

import pytest
from starlette.requests import Request

from gateway import auth
from gateway.config import ApiKey


class FakeRedis:
    def __init__(self, known: dict[str, str]) -> None:
        self.known = known
        self.reads = 0

    async def hget(self, name: str, token: str) -> str | None:
        self.reads += 1
        return self.known.get(token)


def _request(token: str) -> Request:
    return Request({"type": "http", "headers": [(b"authorization", f"Bearer {token}".encode())]})


def test_every_known_key_is_compared_whatever_matches(monkeypatch):
    keys = [ApiKey(f"sk-{i}", f"k{i}") for i in range(5)]
    store = auth.KeyStore(keys, admin_key="admin")
    calls = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for presented in ("sk-0", "sk-4", "sk-nope"):
        calls.clear()
        store._match(auth._digest(presented))
        assert len(calls) == len(keys)  # no early exit on the first match


async def test_cache_of_redis_answers_stays_bounded(monkeypatch):
    monkeypatch.setattr(auth, "REDIS_CACHE_MAX_ENTRIES", 50)
    redis = FakeRedis({"sk-good": '{"name": "good"}'})
    store = auth.KeyStore([], admin_key="admin", redis=redis)
    assert (await store.user(_request("sk-good"))).name == "good"
    for i in range(500):
        try:
            await store.user(_request(f"sk-invented-{i}"))
        except auth.APIError as exc:
            assert exc.status_code == 401
    assert len(store._redis_cache) <= 50
    reads = redis.reads
    with pytest.raises(auth.APIError):
        await store.user(_request("sk-invented-499"))
    assert redis.reads == reads  # the most recent answer is still cached
