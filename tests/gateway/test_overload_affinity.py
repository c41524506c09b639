"""Overload keeps affinity: a request released from the gateway's overload queue waits for the
replica holding its prefix while that replica frees within `overload_affinity_s`, instead of
taking whichever replica frees first; it steps out of line meanwhile, so the requests behind it
take the other replicas; past the window it takes any replica with room. In process, with
replicas that answer through a mock transport (full: 503 engine_overloaded)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from gateway.circuit import CircuitBreaker
from gateway.config import GatewayConfig
from gateway.forward import RoutedRequest, forward
from gateway.replicas import HEALTHY, Replica
from gateway.state import GatewayState
from routing.hashing import block_hashes, namespace_for

pytestmark = pytest.mark.timeout(60)
MODEL = "m"
ANSWER = {"id": "x", "object": "text_completion", "created": 0, "model": MODEL,
          "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
OVERLOADED = {"error": {"message": "busy", "type": "server_error", "param": None,
                        "code": "engine_overloaded"}}


def serve_through(state: GatewayState, answer, names) -> None:
    """Healthy replicas `names` of MODEL in the gateway's state, each answering through
    `answer(request)` (a mock transport: the request's host is the replica's name)."""
    state.proxy = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    for name in names:
        replica = Replica(name, f"http://{name}", CircuitBreaker(), models=[MODEL])
        replica.health = HEALTHY
        state.replicas[name] = replica
        state.router.add_replica(name)


class Fleet:
    """Two replicas, `a` and `b`, full until given room; `a` holds the prefix PREFIX."""

    def __init__(self, affinity_s: float) -> None:
        config = GatewayConfig(admin_key="k", seed=0, overload_affinity_s=affinity_s,
                               prefix_advice=False)
        self.state = GatewayState(config)
        self.room = {"a": False, "b": False}
        self.served: list[tuple[str, str]] = []  # (replica, request id)

        def answer(request: httpx.Request) -> httpx.Response:
            name = request.url.host
            if not self.room[name]:
                return httpx.Response(503, json=OVERLOADED, headers={"Retry-After": "1"})
            self.room[name] = False  # one free place, taken
            self.served.append((name, request.headers["x-request-id"]))
            return httpx.Response(200, json=ANSWER)

        serve_through(self.state, answer, self.room)
        self.prefix = list(range(1, 257))
        self.state.router.on_snapshot("a", {"seq": 1, "block_size": 16, "blocks": self.hashes(
            self.prefix)})

    def hashes(self, tokens: list[int]) -> list[int]:
        return block_hashes(tokens, namespace_for(MODEL, None), 16)

    def send(self, request_id: str, tokens: list[int]) -> asyncio.Task:
        routed = RoutedRequest(request_id, "completions", "/v1/completions",
                               json.dumps({"model": MODEL, "prompt": tokens}).encode(),
                               {"x-request-id": request_id}, MODEL, False, self.hashes(tokens),
                               len(tokens), time.perf_counter())
        return asyncio.create_task(forward(self.state, routed))

    def free(self, name: str) -> None:
        """A request finished on `name`: one place there."""
        self.room[name] = True
        self.state.overload.notify_freed(name)

    async def close(self) -> None:
        await self.state.close()


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_a_released_request_waits_for_the_replica_holding_its_prefix():
    fleet = Fleet(affinity_s=10.0)
    try:
        held = fleet.send("held", fleet.prefix + [7, 8, 9])
        await until(lambda: fleet.state.overload.total_affinity_held == 1)
        fleet.free("b")  # the other replica frees first ...
        await asyncio.sleep(1.5)  # ... longer than the head's retry period
        assert not held.done() and fleet.room["b"]  # it did not take b's place
        fleet.free("a")
        assert (await asyncio.wait_for(held, 5)).status_code == 200
        assert fleet.served == [("a", "held")]
    finally:
        await fleet.close()


async def test_requests_behind_a_held_one_take_the_other_replicas():
    fleet = Fleet(affinity_s=10.0)
    try:
        held = fleet.send("held", fleet.prefix + [7])
        await until(lambda: fleet.state.overload.total_affinity_held == 1)
        behind = fleet.send("behind", [900 + i for i in range(64)])  # a prefix nobody holds
        await until(lambda: len(fleet.state.overload) == 2)
        fleet.free("b")
        assert (await asyncio.wait_for(behind, 5)).status_code == 200
        assert fleet.served == [("b", "behind")] and not held.done()
        fleet.free("a")
        await asyncio.wait_for(held, 5)
        assert fleet.served[-1] == ("a", "held")
    finally:
        await fleet.close()


async def test_past_the_affinity_window_any_replica_with_room_will_do():
    fleet = Fleet(affinity_s=0.5)
    try:
        t0 = time.monotonic()
        held = fleet.send("held", fleet.prefix + [7])
        await until(lambda: fleet.state.overload.total_affinity_held == 1)
        fleet.free("b")
        assert (await asyncio.wait_for(held, 5)).status_code == 200
        assert fleet.served == [("b", "held")] and time.monotonic() - t0 >= 0.5
    finally:
        await fleet.close()
