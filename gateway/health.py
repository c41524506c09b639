"""Active health checks: every replica's `/health` on an interval. 200 is healthy; 503 means
loading or draining (no new requests); no answer means down, which also opens the circuit."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httpx

from gateway.pin_sync import PinSync
from gateway.replicas import DOWN, HEALTHY, UNHEALTHY, Replica

log = logging.getLogger(__name__)


class HealthChecker:
    """Checks replicas; a replica that comes up gets its model list read (`refresh_models`) and
    its pins put back."""

    def __init__(self, client: httpx.AsyncClient, interval_s: float,
                 refresh_models: Callable[[Replica], Awaitable[None]], pins: PinSync) -> None:
        self.client, self.interval_s = client, interval_s
        self.refresh_models, self.pins = refresh_models, pins

    async def check_once(self, replica: Replica) -> None:
        before = replica.health
        try:
            response = await self.client.get(f"{replica.url}/health",
                                             timeout=max(0.5, self.interval_s))
        except (httpx.HTTPError, OSError) as exc:
            replica.health, replica.health_detail = DOWN, type(exc).__name__
            replica.breaker.trip()
            replica.notify_down()
        else:
            if response.status_code == 200:
                replica.health, replica.health_detail = HEALTHY, ""
                if before in (DOWN, UNHEALTHY):
                    # Back from an outage the checks saw themselves: close the circuit. A circuit
                    # opened by failing requests while checks passed keeps its cooldown and trial.
                    replica.breaker.record_success()
                if not replica.models:
                    await self.refresh_models(replica)
                if before != HEALTHY:
                    self.pins.schedule_reconcile(replica)
                else:
                    self.pins.retry_failed(replica)
            else:
                replica.health = UNHEALTHY
                replica.health_detail = f"/health answered {response.status_code}"
                if before == HEALTHY:  # draining (or failed): its streams move before its deadline
                    replica.notify_streams("drain")
        if replica.health != before:
            log.log(logging.INFO if replica.health == HEALTHY else logging.WARNING,
                    "replica %s is %s%s", replica.name, replica.health,
                    f" ({replica.health_detail})" if replica.health_detail else "")

    async def check_forever(self, replica: Replica) -> None:
        while True:
            await self.check_once(replica)
            await asyncio.sleep(self.interval_s)
