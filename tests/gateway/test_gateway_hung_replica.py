"""A replica that accepts connections and never answers: a request waiting for its first byte
gives up on it when the health checks find it down, and a booking's Redis lease is renewed
while the request runs and stops being renewed once it ends."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest

from gateway.circuit import CircuitBreaker
from gateway.forward import _keep_lease, _release
from gateway.replicas import Replica
from gateway.upstream import UpstreamFailure, open_until_down


async def _silent_server() -> tuple[asyncio.AbstractServer, list[asyncio.Event]]:
    """Accepts, reads, never answers; each connection's event is set when the peer hangs up."""
    closed: list[asyncio.Event] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        done = asyncio.Event()
        closed.append(done)
        while await reader.read(65536):
            pass
        done.set()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), closed


async def test_waiting_request_gives_up_when_the_replica_is_found_down():
    server, closed = await _silent_server()
    port = server.sockets[0].getsockname()[1]
    replica = Replica("silent", f"http://127.0.0.1:{port}", CircuitBreaker())
    async with httpx.AsyncClient(timeout=30) as client:
        attempt = asyncio.ensure_future(open_until_down(client, replica, "/v1/completions", b"{}", {}))
        await asyncio.sleep(0.3)
        assert not attempt.done() and len(replica.down_waiters) == 1
        t0 = time.monotonic()
        replica.notify_down()
        with pytest.raises(UpstreamFailure) as failure:
            await attempt
        assert failure.value.reason == "down" and time.monotonic() - t0 < 1.0
        assert not replica.down_waiters
        await asyncio.wait_for(closed[0].wait(), 5)  # the connection to it was closed
    server.close()
    await server.wait_closed()


async def test_answer_before_any_outage_is_returned_and_forgets_its_waiter():
    replica = Replica("ok", "http://replica", CircuitBreaker())
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json={"ok": True}))
    async with httpx.AsyncClient(transport=transport) as client:
        response = await open_until_down(client, replica, "/v1/completions", b"{}", {})
        assert response.status_code == 200
        await response.aclose()
    assert not replica.down_waiters


async def test_lease_is_renewed_while_the_request_runs_and_not_after():
    renewed: list[tuple[str, str]] = []
    finished: list[str] = []

    async def renew(replica: str, request_id: str) -> bool:
        renewed.append((replica, request_id))
        return True

    async def finish(request_id: str) -> None:
        finished.append(request_id)

    freed: list[bool] = []
    state = SimpleNamespace(store=SimpleNamespace(lease_ms=60, renew=renew),
                            shared=SimpleNamespace(finish=finish),
                            overload=SimpleNamespace(notify_freed=lambda *_: freed.append(True)))
    decision = SimpleNamespace(replica="r1", request_id="q1")
    lease = _keep_lease(state, decision)
    await asyncio.sleep(0.15)
    assert len(renewed) >= 3 and set(renewed) == {("r1", "q1")}
    await _release(state, decision, lease)
    count = len(renewed)
    await asyncio.sleep(0.1)
    assert len(renewed) == count and finished == ["q1"] and lease.cancelled()
    assert freed == [True]  # a request queued at the gateway may take the freed place


def test_no_lease_to_keep_without_redis():
    assert _keep_lease(SimpleNamespace(store=None), SimpleNamespace(replica="r", request_id="q")) is None
