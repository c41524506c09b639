"""Bearer-token authentication: user keys for /v1/*, the admin key for /admin/api/*.

Keys are compared as SHA-256 digests with hmac.compare_digest against every known key, so the
time taken says nothing about how much of a key matched. Keys may also live in Redis (a hash
`kvgate:keys` of key -> JSON {name, rpm, tpm, isolate_cache, priority, max_priority}), looked
up on a local miss.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time

from starlette.requests import Request

from gateway.config import ApiKey, check_key_priority
from protocol.errors import APIError, unauthorized
from protocol.http import api_key_of, bearer_token

log = logging.getLogger(__name__)
REDIS_CACHE_MAX_ENTRIES = 10_000
REDIS_KEYS_HASH = "kvgate:keys"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer(request: Request) -> str | None:
    return bearer_token(request.headers.get("authorization", ""))


def forbidden(message: str) -> APIError:
    return APIError(403, message, "invalid_request_error", None, "forbidden")


class KeyStore:
    def __init__(self, keys: list[ApiKey], admin_key: str | None, redis=None,
                 redis_cache_s: float = 10.0) -> None:
        self._keys = [(_digest(k.key), k) for k in keys]
        self._admin = _digest(admin_key) if admin_key else None
        self.redis = redis  # redis.asyncio client, or None
        self.redis_cache_s = redis_cache_s
        self._redis_cache: dict[bytes, tuple[float, ApiKey | None]] = {}

    @property
    def open_access(self) -> bool:
        """No user keys anywhere: /v1/* needs no key (a local, trusted setup)."""
        return not self._keys and self.redis is None

    def _match(self, digest: bytes) -> ApiKey | None:
        found = None
        for known, key in self._keys:  # no early exit: constant work per presented key
            if hmac.compare_digest(known, digest):
                found = key
        return found

    def is_admin(self, token: str | None) -> bool:
        return token is not None and self._admin is not None and hmac.compare_digest(
            self._admin, _digest(token))

    async def user(self, request: Request) -> ApiKey | None:
        """The caller's key, None in open access; 401 when missing or wrong."""
        return await self.user_token(api_key_of(request.headers))

    async def user_token(self, token: str | None) -> ApiKey | None:
        """`user` for a key read elsewhere (the endpoint picker's request headers)."""
        if self.open_access and token is None:
            return None
        if token is None:
            raise unauthorized("You didn't provide an API key. Provide it as "
                               "'Authorization: Bearer KEY' or 'x-api-key: KEY'.")
        digest = _digest(token)
        key = self._match(digest) or await self._from_redis(digest, token)
        if key is None:
            if self.is_admin(token):
                return ApiKey(token, "admin")  # the admin may use the API too
            if self.open_access:
                return None
            raise unauthorized()
        return key

    def admin(self, request: Request) -> None:
        token = bearer(request)
        if token is None:
            raise unauthorized("The admin API needs the admin key as 'Authorization: Bearer KEY'.")
        if self.is_admin(token):
            return
        if self._match(_digest(token)) is not None:
            raise forbidden("This key is not the admin key.")
        raise unauthorized()

    async def _from_redis(self, digest: bytes, token: str) -> ApiKey | None:
        if self.redis is None:
            return None
        cached = self._redis_cache.get(digest)
        now = time.monotonic()
        if cached is not None and cached[0] > now:
            return cached[1]
        key = None
        try:
            raw = await self.redis.hget(REDIS_KEYS_HASH, token)
        except Exception as exc:  # noqa: BLE001 - any Redis failure
            # Redis down: keys it vouched for before keep working; unknown ones are refused.
            log.warning("cannot read API keys from redis: %s", exc)
            return cached[1] if cached is not None else None
        if raw:
            try:
                meta = json.loads(raw)
                key = ApiKey(token, str(meta.get("name") or "redis-key"), meta.get("rpm"),
                             meta.get("tpm"), bool(meta.get("isolate_cache", False)),
                             meta.get("priority", 0), meta.get("max_priority"))
                check_key_priority(key.priority, key.max_priority)
            except (ValueError, AttributeError):
                key = None
                log.warning("ignoring a malformed API key entry in redis")
        self._remember(digest, now, key)
        return key

    def _remember(self, digest: bytes, now: float, key: ApiKey | None) -> None:
        """Cache a Redis answer; bounded, since every wrong key a client invents adds one."""
        cache = self._redis_cache
        if len(cache) >= REDIS_CACHE_MAX_ENTRIES:
            for old in [d for d, (expires, _) in cache.items() if expires <= now]:
                del cache[old]
            while len(cache) >= REDIS_CACHE_MAX_ENTRIES:
                del cache[next(iter(cache))]  # the oldest entry
        cache[digest] = (now + self.redis_cache_s, key)
