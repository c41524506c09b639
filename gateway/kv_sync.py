"""Keeps one replica's exact prefix index current: read `/kv/snapshot`, then follow
`/kv/events?since=SEQ`; re-read the snapshot on a sequence gap or a `resync` event; reconnect
with jittered exponential backoff when the replica goes away. A replica without `/kv/*` (any
OpenAI-compatible server) is switched to the approximate index instead."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable

import httpx

from gateway.pin_sync import PinSync
from gateway.replicas import Replica
from routing.index import BlockSizeMismatch
from routing.router import Router

log = logging.getLogger(__name__)

MIN_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
# Heartbeats come after 1 s idle; three missed ones mean the stream is dead.
EVENT_READ_TIMEOUT_S = 3.5


class NoKvEndpoints(Exception):
    """The backend does not serve /kv/snapshot: route it with the approximate index."""


class KvSync:
    """Follows replicas' /kv feeds into the router's index; a replica re-read from its snapshot
    gets its pins put back, one without /kv is handed to `use_approximate_index`."""

    def __init__(self, client: httpx.AsyncClient, router: Router, pins: PinSync,
                 use_approximate_index: Callable[[Replica], None]) -> None:
        self.client, self.router, self.pins = client, router, pins
        self.use_approximate_index = use_approximate_index

    async def follow(self, replica: Replica) -> None:
        """Run until cancelled."""
        backoff = MIN_BACKOFF_S
        while True:
            try:
                await self._sync_once(replica)
                backoff = MIN_BACKOFF_S  # the stream ended cleanly (resync or gap): re-read at once
                continue
            except asyncio.CancelledError:
                raise
            except NoKvEndpoints:
                self.use_approximate_index(replica)
                return
            except BlockSizeMismatch as exc:
                log.error("replica %s cannot be indexed: %s", replica.name, exc)
                replica.kv_connected = False
                await asyncio.sleep(MAX_BACKOFF_S * 6)
                continue
            except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:
                if replica.kv_connected:
                    log.warning("kv feed of %s lost (%s); reconnecting", replica.name, exc)
                replica.kv_connected = False
            await asyncio.sleep(backoff * random.uniform(0.5, 1.5))
            backoff = min(MAX_BACKOFF_S, backoff * 2)

    async def _sync_once(self, replica: Replica) -> None:
        response = await self.client.get(f"{replica.url}/kv/snapshot", timeout=10.0)
        if response.status_code in (404, 405):
            raise NoKvEndpoints()
        response.raise_for_status()
        snapshot = response.json()
        self.router.on_snapshot(replica.name, snapshot)
        replica.namespace_model = snapshot.get("model") or replica.namespace_model
        replica.role = snapshot.get("role") or "both"
        replica.kv_transfer_address = snapshot.get("kv_transfer_address")
        replica.load = dict(snapshot.get("load") or {})
        self.pins.schedule_reconcile(replica)  # a restarted replica lost its pins
        seq = int(snapshot.get("seq", 0))
        timeout = httpx.Timeout(10.0, read=EVENT_READ_TIMEOUT_S)
        async with self.client.stream("GET", f"{replica.url}/kv/events", params={"since": seq},
                                      timeout=timeout) as events:
            events.raise_for_status()
            replica.kv_connected = True
            async for line in events.aiter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                kind = event.get("type", "kv")
                if event.get("load") is not None:
                    replica.load = dict(event["load"])
                if kind == "heartbeat":
                    self.router.load.observe_engine(replica.name, event.get("load"))
                elif kind == "resync":
                    return
                elif not self.router.on_event(replica.name, event):
                    return  # a gap: re-read the snapshot
                elif "ts" in event:
                    replica.event_lag_s = max(0.0, time.time() - float(event["ts"]))
        raise httpx.ReadError("event stream ended")
