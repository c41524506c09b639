"""Active health checks: every replica's `/health` on an interval. 200 is healthy; 503 means
loading or draining (no new requests); no answer means down, which also opens the circuit."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import httpx

from gateway.replicas import DOWN, HEALTHY, UNHEALTHY

if TYPE_CHECKING:
    from gateway.replicas import Replica
    from gateway.state import GatewayState

log = logging.getLogger(__name__)


async def check_once(state: GatewayState, replica: Replica) -> None:
    before = replica.health
    try:
        response = await state.client.get(f"{replica.url}/health",
                                          timeout=max(0.5, state.config.health_interval_s))
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
                await state.refresh_models(replica)
            if before != HEALTHY:
                state.pin_sync.schedule_reconcile(replica)
            else:
                state.pin_sync.retry_failed(replica)
        else:
            replica.health = UNHEALTHY
            replica.health_detail = f"/health answered {response.status_code}"
    if replica.health != before:
        log.log(logging.INFO if replica.health == HEALTHY else logging.WARNING,
                "replica %s is %s%s", replica.name, replica.health,
                f" ({replica.health_detail})" if replica.health_detail else "")


async def check_forever(state: GatewayState, replica: Replica) -> None:
    while True:
        await check_once(state, replica)
        await asyncio.sleep(state.config.health_interval_s)
