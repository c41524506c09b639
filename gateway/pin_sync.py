"""Puts the stored pins on the replicas: each new pin goes to every healthy replica serving its
model, and a replica is reconciled (missing pins pushed, stale gateway pins removed) whenever
its KV feed re-reads the snapshot or its health check sees it come back, which is exactly
when a restarted replica, whose cache is empty, needs its pins re-warmed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import httpx
from prometheus_client import Counter

from gateway.pins import GATEWAY_PIN_PREFIX, PinRecord, PinStore
from gateway.replicas import HEALTHY, Replica, serving

log = logging.getLogger(__name__)
PUSH_TIMEOUT_S = 120.0  # warming a long prefix on a CPU replica takes a while
RETRY_FAILED_S = 15.0  # a push that failed (5xx, timeout) is retried this often; refusals are not

PINNED, REFUSED, FAILED = "pinned", "refused", "failed"


class PinSync:
    def __init__(self, client: httpx.AsyncClient, store: PinStore, replicas: Mapping[str, Replica],
                 pushes: Counter) -> None:
        self.client, self.store, self.replicas, self.pushes = client, store, replicas, pushes
        self.status: dict[str, dict[str, dict]] = {}  # pin id → replica name → outcome
        self._tasks: dict[str, asyncio.Task] = {}  # running reconciliations, by replica name
        self._last_reconcile: dict[str, float] = {}

    def targets(self, model: str) -> list[Replica]:
        return [r for r in serving(self.replicas.values(), model) if r.health == HEALTHY and r.exact]

    async def push(self, record: PinRecord, replica: Replica) -> dict:
        try:
            response = await self.client.post(f"{replica.url}/admin/pins",
                                              json=record.replica_body(), timeout=PUSH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            outcome = {"state": FAILED, "detail": f"{type(exc).__name__}: {exc}"}
        else:
            outcome = _outcome(response)
        self.status.setdefault(record.pin_id, {})[replica.name] = outcome
        self.pushes.labels(outcome["state"]).inc()
        if outcome["state"] != PINNED:
            log.warning("pin %s on %s: %s", record.pin_id, replica.name, outcome.get("detail"))
        return outcome

    async def push_all(self, record: PinRecord) -> dict[str, dict]:
        replicas = self.targets(record.model)
        outcomes = await asyncio.gather(*(self.push(record, r) for r in replicas))
        return {r.name: o for r, o in zip(replicas, outcomes)}

    async def remove_all(self, pin_id: str) -> None:
        """Unpin everywhere; a replica that misses this drops the pin when next reconciled."""
        self.status.pop(pin_id, None)
        await asyncio.gather(*(self._delete(r, pin_id) for r in list(self.replicas.values())
                               if r.exact))

    async def _delete(self, replica: Replica, pin_id: str) -> None:
        try:
            await self.client.delete(f"{replica.url}/admin/pins/{pin_id}", timeout=10.0)
        except httpx.HTTPError as exc:  # its next reconciliation removes the stale pin
            log.warning("cannot remove pin %s from %s: %s", pin_id, replica.name, exc)

    def schedule_reconcile(self, replica: Replica) -> None:
        running = self._tasks.get(replica.name)
        if running is not None and not running.done():
            return
        self._last_reconcile[replica.name] = time.monotonic()
        self._tasks[replica.name] = asyncio.create_task(self.reconcile(replica))

    def retry_failed(self, replica: Replica) -> None:
        """Called by the health checker: reconcile again if a push to this replica failed."""
        since = time.monotonic() - self._last_reconcile.get(replica.name, 0.0)
        if since >= RETRY_FAILED_S and any(per.get(replica.name, {}).get("state") == FAILED
                                           for per in self.status.values()):
            self.schedule_reconcile(replica)

    async def reconcile(self, replica: Replica) -> None:
        """Make the replica hold exactly the stored pins of the models it serves."""
        try:
            response = await self.client.get(f"{replica.url}/admin/pins", timeout=10.0)
            response.raise_for_status()
            present = {p["id"]: p for p in response.json().get("data", [])}
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            log.info("pins of %s not reconciled now: %s", replica.name, exc)
            return
        records = [r for r in await self.store.all() if r.model in replica.models]
        wanted = {r.pin_id for r in records}
        pushed = []
        for record in records:
            if record.pin_id in present:
                self.status.setdefault(record.pin_id, {})[replica.name] = _pinned(present[record.pin_id])
            else:
                log.info("re-warming pin %s on %s", record.pin_id, replica.name)
                await self.push(record, replica)
                pushed.append(record.pin_id)
        for pin_id in present:
            if pin_id.startswith(GATEWAY_PIN_PREFIX) and pin_id not in wanted:
                await self._delete(replica, pin_id)
        if pushed:  # an admin may have removed one while it was warming
            still = {r.pin_id for r in await self.store.all()}
            for pin_id in set(pushed) - still:
                self.status.pop(pin_id, None)
                await self._delete(replica, pin_id)

    def forget_replica(self, name: str) -> None:
        for per_replica in self.status.values():
            per_replica.pop(name, None)
        self._last_reconcile.pop(name, None)
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)


def _pinned(view: dict) -> dict:
    return {"state": PINNED, "num_tokens": view.get("num_tokens"), "num_blocks": view.get("num_blocks")}


def _outcome(response: httpx.Response) -> dict:
    try:
        body = response.json()
    except ValueError:
        body = {}
    if response.status_code == 200:
        return _pinned(body)
    error = body.get("error") if isinstance(body, dict) else None
    detail = error.get("message") if isinstance(error, dict) else response.text[:200]
    state = REFUSED if 400 <= response.status_code < 500 else FAILED
    return {"state": state, "detail": detail, "http_status": response.status_code,
            "error": error if isinstance(error, dict) else None}
