"""Tokenizers fetched from kvgate replicas (`GET /tokenizer/bundle`), one per model, named by the
bundle's content hash: the first replica of a model supplies it, every later one only confirms
the hash (If-None-Match, 304). A replica whose bundle hashes differently is refused - the
gateway keeps the tokenizer it has and says so - and a replica that serves no bundle (vLLM,
SGLang, llama.cpp) leaves the model to remote tokenisation."""

from __future__ import annotations

import asyncio
import logging

import httpx

from gateway.tokenizer import LocalTokenizer
from protocol.tokenizer_bundle import (BUNDLE_PATH, MAX_BUNDLE_BYTES, BundleError, content_hash,
                                       decode_bundle)

log = logging.getLogger(__name__)

LOADED, SAME, ABSENT = "loaded", "same", "absent"


class ReplicaTokenizers:
    def __init__(self, client: httpx.AsyncClient, max_bytes: int = MAX_BUNDLE_BYTES) -> None:
        self.client = client
        self.max_bytes = max_bytes
        self._loaded: dict[str, tuple[str, LocalTokenizer]] = {}  # model -> (hash, tokenizer)
        self._locks: dict[str, asyncio.Lock] = {}

    def get(self, model: str) -> LocalTokenizer | None:
        entry = self._loaded.get(model)
        return entry[1] if entry else None

    def digest(self, model: str) -> str | None:
        entry = self._loaded.get(model)
        return entry[0] if entry else None

    async def sync(self, model: str, replica_url: str, block_size: int) -> str:
        """Load or confirm `model`'s tokenizer from one replica: 'loaded', 'same', 'absent' (it
        serves no bundle), 'mismatch: …' (refused) or 'unavailable: …'."""
        async with self._locks.setdefault(model, asyncio.Lock()):
            known = self.digest(model)
            try:
                payload = await self._download(replica_url, known)
            except (httpx.HTTPError, BundleError) as exc:
                return f"unavailable: tokenizer bundle ({exc or type(exc).__name__})"
            if payload is None:
                return SAME
            if not payload:
                return ABSENT
            digest = content_hash(payload)
            if known is not None:
                return SAME if digest == known else (
                    f"mismatch: tokenizer {digest[:19]} differs from {known[:19]} that other "
                    f"replicas of {model} serve")
            try:
                bundle = decode_bundle(payload)
                if bundle.model != model:
                    raise BundleError(f"the bundle is for model {bundle.model!r}")
                if bundle.block_size != block_size:
                    return (f"mismatch: the replica hashes blocks of {bundle.block_size} tokens, "
                            f"this gateway of {block_size} (--block-size)")
                tokenizer = await asyncio.to_thread(LocalTokenizer.from_bundle, bundle, digest)
            except ValueError as exc:  # BundleError included
                return f"unavailable: tokenizer bundle refused ({exc})"
            self._loaded[model] = (digest, tokenizer)
            return LOADED

    async def _download(self, url: str, known: str | None) -> bytes | None:
        """The bundle's bytes; None when not modified (304), b"" when not served (404…)."""
        headers = {"If-None-Match": f'"{known}"'} if known else {}
        async with self.client.stream("GET", url + BUNDLE_PATH, headers=headers,
                                      timeout=30.0) as response:
            if response.status_code == 304:
                return None
            if response.status_code in (404, 405, 501):
                return b""
            response.raise_for_status()
            if int(response.headers.get("content-length") or 0) > self.max_bytes:
                raise BundleError(f"larger than {self.max_bytes} bytes")
            payload = bytearray()
            async for chunk in response.aiter_bytes():
                payload += chunk
                if len(payload) > self.max_bytes:
                    raise BundleError(f"larger than {self.max_bytes} bytes")
            return bytes(payload)
