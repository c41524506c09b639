"""The endpoint picker's flow control, in process: a replica whose load report says it would
refuse the request (the wait for a first token over its admission bound) is passed over with
nothing booked there; when every replica would, the request waits in the overload queue and is
picked once one has room; a wait past the bound is the gateway's 503; a cancelled wait (the
client went away) leaves neither a place in the queue nor a booking."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.circuit import CircuitBreaker
from gateway.config import GatewayConfig
from gateway.forward import RoutedRequest
from gateway.picker import flow
from gateway.replicas import HEALTHY, Replica
from gateway.state import GatewayState
from protocol.errors import APIError

pytestmark = pytest.mark.timeout(60)
MODEL = "m"
IDLE = {"running": 0, "waiting": 0, "queue_delay_s": 0.0, "max_queue_delay_s": 10.0,
        "drain_rate_tok_s": 100.0}
FULL = {**IDLE, "running": 4, "waiting": 8, "queue_delay_s": 30.0}  # 20 s over its bound


def fleet(max_queue_wait_s: float = 60.0) -> GatewayState:
    state = GatewayState(GatewayConfig(admin_key="k", seed=0, prefix_advice=False,
                                       max_queue_wait_s=max_queue_wait_s))
    for name in ("a", "b"):
        replica = Replica(name, f"http://{name}", CircuitBreaker(), models=[MODEL])
        replica.health = HEALTHY
        state.replicas[name] = replica
        state.router.add_replica(name)
    return state


def request(request_id: str) -> RoutedRequest:
    return RoutedRequest(request_id, "completions", "/v1/completions", b"{}", {}, MODEL, False,
                         [11, 12, 13], 64, time.perf_counter())


async def pick(state: GatewayState, request_id: str, queued: list[float]):
    async def no_exclusions() -> set[str]:
        return set()

    return await flow.route_with_room(state, request(request_id), no_exclusions, queued.append)


def booked(state: GatewayState) -> int:
    return sum(state.router.load.view(name).in_flight for name in state.replicas)


async def test_a_replica_that_would_refuse_is_passed_over():
    state = fleet()
    try:
        state.router.load.observe_engine("a", FULL)
        state.router.load.observe_engine("b", IDLE)
        queued: list[float] = []
        for i in range(3):
            decision = await pick(state, f"r{i}", queued)
            assert decision.replica == "b"
        assert queued == [] and len(state.overload) == 0
        assert state.router.load.view("b").in_flight == 3 and state.router.load.view("a").in_flight == 12  # its own load only
    finally:
        await state.close()


async def test_when_every_replica_would_refuse_the_request_waits_for_room():
    state = fleet()
    try:
        for name in ("a", "b"):
            state.router.load.observe_engine(name, FULL)
        queued: list[float] = []
        waiting = asyncio.create_task(pick(state, "waits", queued))
        await asyncio.sleep(0.3)
        assert not waiting.done() and len(state.overload) == 1 and queued == [60.0]
        state.router.load.observe_engine("a", IDLE)  # a's report: its queue drained
        decision = await asyncio.wait_for(waiting, 5)
        assert decision.replica == "a" and len(state.overload) == 0
        assert state.overload.summary()["total_queued"] == 1
    finally:
        await state.close()


async def test_a_wait_past_the_bound_is_the_gateways_503():
    state = fleet(max_queue_wait_s=0.3)
    try:
        for name in ("a", "b"):
            state.router.load.observe_engine(name, FULL)
        with pytest.raises(APIError) as refused:
            await pick(state, "late", [])
        assert refused.value.status_code == 503 and refused.value.code == "gateway_overloaded"
        assert int(refused.value.headers["Retry-After"]) >= 1
        assert len(state.overload) == 0 and booked(state) == 2 * 12  # the engines' own, only
    finally:
        await state.close()


async def test_a_cancelled_wait_leaves_no_place_and_no_booking():
    state = fleet()
    try:
        for name in ("a", "b"):
            state.router.load.observe_engine(name, FULL)
        waiting = asyncio.create_task(pick(state, "gone", []))
        await asyncio.sleep(0.3)
        assert len(state.overload) == 1
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert len(state.overload) == 0
        assert state.router.load.booking("gone") is None and booked(state) == 2 * 12
    finally:
        await state.close()
