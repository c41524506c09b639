"""Tokenisation through a replica's `/tokenize`, for models whose replicas serve no tokenizer
bundle (vLLM, SGLang, llama.cpp): each call goes to the least-loaded replica of the model
(requests in flight there plus this gateway's own /tokenize calls, ties taken in turn, never
"the first"), identical prompts asked at once share one call, and answers are kept a few
seconds by prompt hash, so a burst of retries or siblings costs one round trip."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import httpx

from protocol.errors import APIError, bad_request

CACHE_TTL_S = 10.0
CACHE_ENTRIES = 4096
CACHE_TOKENS = 8 * 1024 * 1024  # at 4 bytes a token: the cache holds at most 32 MiB


class RemoteTokenizer:
    def __init__(self, client: httpx.AsyncClient, ttl_s: float = CACHE_TTL_S,
                 max_entries: int = CACHE_ENTRIES) -> None:
        self.client = client
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._cache: OrderedDict[str, tuple[float, array]] = OrderedDict()
        self._cached_tokens = 0
        self._pending: dict[str, asyncio.Future] = {}
        self.in_flight: dict[str, int] = {}  # replica URL -> our /tokenize calls there now
        self.calls: dict[str, int] = {}  # replica URL -> /tokenize calls made (dashboard, tests)
        self._turn = itertools.count()

    def pick(self, candidates: Sequence[tuple[str, int]]) -> str:
        """The URL with the least load: `candidates` are (url, requests in flight there)."""
        loads = {url: load + self.in_flight.get(url, 0) for url, load in candidates}
        least = min(loads.values())
        ties = sorted(url for url, load in loads.items() if load == least)
        return ties[next(self._turn) % len(ties)]

    async def tokens(self, candidates: Sequence[tuple[str, int]], body: dict) -> list[int]:
        if not candidates:
            raise APIError(503, "No replica can tokenize this request.", "server_error", None,
                           "service_unavailable", {"Retry-After": "1"})
        key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        hit = self._cache.get(key)
        if hit is not None and time.monotonic() - hit[0] < self.ttl_s:
            return list(hit[1])
        pending = self._pending.get(key)
        if pending is not None:
            try:
                return list(await asyncio.shield(pending))
            except asyncio.CancelledError:
                if not pending.cancelled():
                    raise  # this request was cancelled, not the call it waited on
        return await self._call(key, candidates, body)

    async def _call(self, key: str, candidates: Sequence[tuple[str, int]], body: dict) -> list[int]:
        future = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            tokens = await self.post(self.pick(candidates), body)
        except asyncio.CancelledError:
            future.cancel()  # whoever waited on it asks again
            raise
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # marked retrieved: no "never retrieved" warning when unshared
            raise
        finally:
            self._pending.pop(key, None)
        future.set_result(tokens)
        self._remember(key, tokens)
        return list(tokens)

    async def post(self, url: str, body: dict) -> list[int]:
        """One /tokenize call to one replica (raises APIError 400 for the caller's bad input)."""
        self.in_flight[url] = self.in_flight.get(url, 0) + 1
        self.calls[url] = self.calls.get(url, 0) + 1
        try:
            response = await self.client.post(f"{url}/tokenize", json=body, timeout=10.0)
        finally:
            self.in_flight[url] -= 1
        if response.status_code == 400:
            error = response.json().get("error", {})
            raise bad_request(error.get("message", "invalid request"), error.get("param"))
        response.raise_for_status()
        return list(response.json()["tokens"])

    def _remember(self, key: str, tokens: list[int]) -> None:
        try:
            packed = array("I", tokens)
        except (OverflowError, TypeError):  # not token ids: pass them on, keep nothing
            return
        old = self._cache.pop(key, None)
        if old is not None:
            self._cached_tokens -= len(old[1])
        self._cache[key] = (time.monotonic(), packed)
        self._cached_tokens += len(tokens)
        while self._cache and (len(self._cache) > self.max_entries
                               or self._cached_tokens > CACHE_TOKENS):
            self._cached_tokens -= len(self._cache.popitem(last=False)[1][1])
