"""PinSync against replicas faked with httpx.MockTransport: reconciliation pushes missing pins,
removes stale gateway pins (never foreign ones), and a failed push is retried, a refusal not."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx

from gateway import pin_sync
from gateway.circuit import CircuitBreaker
from gateway.metrics import GatewayMetrics
from gateway.pin_sync import PinSync
from gateway.pins import PinRecord, PinStore
from gateway.replicas import HEALTHY, Replica

MODEL = "m"


@dataclass
class FakeReplicaServer:
    pins: dict[str, dict] = field(default_factory=dict)
    fail_posts: int = 0  # answer this many POSTs with 500 first
    calls: list[str] = field(default_factory=list)

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(f"{request.method} {request.url.path}")
        if request.method == "GET":
            return httpx.Response(200, json={"data": list(self.pins.values())})
        if request.method == "DELETE":
            pin_id = request.url.path.rsplit("/", 1)[1]
            return httpx.Response(200 if self.pins.pop(pin_id, None) else 404, json={})
        if self.fail_posts:
            self.fail_posts -= 1
            return httpx.Response(500, json={"error": {"message": "boom", "type": "server_error"}})
        body = json.loads(request.content)
        self.pins[body["id"]] = {"id": body["id"], "num_tokens": 32, "num_blocks": 2}
        return httpx.Response(200, json=self.pins[body["id"]])


class FakeGateway:
    def __init__(self, server: FakeReplicaServer) -> None:
        self.client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: server.handle(r)))
        self.replica = Replica("r1", "http://r1", CircuitBreaker(3, 5.0), models=[MODEL], health=HEALTHY)
        self.replicas = {"r1": self.replica}
        self.metrics = GatewayMetrics()
        self.pin_store = PinStore()

    def pin_sync(self) -> PinSync:
        return PinSync(self.client, self.pin_store, self.replicas, self.metrics.pin_pushes)


async def test_reconcile_pushes_missing_pins_and_removes_only_stale_gateway_pins():
    server = FakeReplicaServer(pins={"gw-stale": {"id": "gw-stale"}, "ops-own": {"id": "ops-own"}})
    state = FakeGateway(server)
    sync = state.pin_sync()
    await state.pin_store.put(PinRecord("gw-1", MODEL, {"prompt": "x" * 64}, "x"))
    await state.pin_store.put(PinRecord("gw-other-model", "other", {"prompt": "y" * 64}, "y"))
    await sync.reconcile(state.replica)
    assert sorted(server.pins) == ["gw-1", "ops-own"]
    assert sync.status["gw-1"]["r1"] == {"state": "pinned", "num_tokens": 32, "num_blocks": 2}
    await sync.reconcile(state.replica)  # nothing left to do: no second push
    assert server.calls.count("POST /admin/pins") == 1
    await state.client.aclose()


async def test_a_failed_push_is_retried_by_the_health_checker(monkeypatch):
    monkeypatch.setattr(pin_sync, "RETRY_FAILED_S", 0.0)
    server = FakeReplicaServer(fail_posts=1)
    state = FakeGateway(server)
    sync = state.pin_sync()
    record = PinRecord("gw-1", MODEL, {"prompt": "x" * 64}, "x")
    await state.pin_store.put(record)
    outcome = await sync.push(record, state.replica)
    assert outcome["state"] == "failed" and outcome["http_status"] == 500
    sync.retry_failed(state.replica)
    await asyncio.gather(*sync._tasks.values())
    assert sync.status["gw-1"]["r1"]["state"] == "pinned" and "gw-1" in server.pins
    await state.client.aclose()


async def test_a_refused_push_is_not_retried(monkeypatch):
    monkeypatch.setattr(pin_sync, "RETRY_FAILED_S", 0.0)
    state = FakeGateway(FakeReplicaServer())
    sync = state.pin_sync()
    sync.status["gw-1"] = {"r1": {"state": "refused", "detail": "over capacity"}}
    sync.retry_failed(state.replica)
    assert not sync._tasks
    await state.client.aclose()


async def test_a_pin_removed_while_it_was_warming_is_removed_from_the_replica():
    server = FakeReplicaServer()
    state = FakeGateway(server)
    sync = state.pin_sync()
    await state.pin_store.put(PinRecord("gw-1", MODEL, {"prompt": "x" * 64}, "x"))
    original = server.handle

    def delete_during_warm(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            state.pin_store._local.clear()  # the admin's DELETE lands while the replica warms
        return original(request)

    server.handle = delete_during_warm
    await sync.reconcile(state.replica)
    assert server.pins == {} and "gw-1" not in sync.status
    await state.client.aclose()
