"""The overload queue is a line for room, not for answers: once its head is sent to a replica
expected to admit it, the next request goes at once, though the first one's answer (from a
kvgate replica, its first token) is still to come; a request refused after all goes back to its
place in line, ahead of those behind it. In process, with replicas behind a mock transport
that answer after a delay (the time to a first token) or refuse (503 engine_overloaded)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from gateway.config import GatewayConfig
from gateway.forward import RoutedRequest, forward
from gateway.state import GatewayState
from routing.hashing import block_hashes, namespace_for
from tests.gateway.test_overload_affinity import ANSWER, MODEL, OVERLOADED, serve_through, until

pytestmark = pytest.mark.timeout(60)
FIRST_TOKEN_S = 1.0


class Fleet:
    """Two replicas, each admitting `places` requests at a time (closed until `open`); an
    admitted request is answered FIRST_TOKEN_S later."""

    def __init__(self, places: int) -> None:
        self.state = GatewayState(GatewayConfig(admin_key="k", seed=0, overload_affinity_s=0,
                                                prefix_advice=False))
        self.places = places
        self.open = False
        self.running = {"a": 0, "b": 0}
        self.admitted: list[tuple[float, str]] = []  # (time, request id)
        self.refuse_next: set[str] = set()  # request ids refused once more, whatever the room

        async def answer(request: httpx.Request) -> httpx.Response:
            name, rid = request.url.host, request.headers["x-request-id"]
            if not self.open or self.running[name] >= self.places or rid in self.refuse_next:
                self.refuse_next.discard(rid)
                return httpx.Response(503, json=OVERLOADED, headers={"Retry-After": "1"})
            self.running[name] += 1
            self.admitted.append((time.monotonic(), rid))
            try:
                await asyncio.sleep(FIRST_TOKEN_S)
            finally:
                self.running[name] -= 1
            return httpx.Response(200, json=ANSWER)

        serve_through(self.state, answer, self.running)

    def send(self, request_id: str) -> asyncio.Task:
        tokens = [hash(request_id) % 1000 + i for i in range(64)]
        routed = RoutedRequest(request_id, "completions", "/v1/completions",
                               json.dumps({"model": MODEL, "prompt": tokens}).encode(),
                               {"x-request-id": request_id}, MODEL, False,
                               block_hashes(tokens, namespace_for(MODEL, None), 16),
                               len(tokens), time.perf_counter())
        return asyncio.create_task(forward(self.state, routed))

    def free(self) -> None:
        self.open = True
        self.state.overload.notify_freed()


async def test_queued_requests_are_sent_together_not_one_first_token_apart():
    fleet = Fleet(places=4)
    try:
        tasks = [fleet.send(f"r{i}") for i in range(6)]
        await until(lambda: len(fleet.state.overload) == 6)  # every replica refused: all queued
        t0 = time.monotonic()
        fleet.free()
        answers = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert [a.status_code for a in answers] == [200] * 6
        # all six admitted at once (room for eight), in arrival order, not one per first token
        assert [rid for _, rid in fleet.admitted] == [f"r{i}" for i in range(6)]
        assert max(t for t, _ in fleet.admitted) - t0 < FIRST_TOKEN_S / 2
        assert len(fleet.state.overload) == 0
    finally:
        await fleet.state.close()


async def test_a_request_refused_after_it_was_sent_keeps_its_place_in_line():
    fleet = Fleet(places=1)
    try:
        tasks = [fleet.send(f"r{i}") for i in range(4)]
        await until(lambda: len(fleet.state.overload) == 4)
        fleet.refuse_next.add("r0")  # sent where it was expected to fit, and refused there
        fleet.free()
        answers = await asyncio.wait_for(asyncio.gather(*tasks), 15)
        assert [a.status_code for a in answers] == [200] * 4
        order = [rid for _, rid in fleet.admitted]
        # r1 took the place r0 was refused, r2 the other replica's; then r0 before r3
        assert order.index("r0") < order.index("r3")
        assert fleet.state.overload.summary()["total_timed_out"] == 0
    finally:
        await fleet.state.close()
