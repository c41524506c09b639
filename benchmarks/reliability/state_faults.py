"""Faults of shared state and of the gateways themselves: Redis killed and restarted under load,
a gateway killed with requests in flight, clients that leave at random points."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time

import httpx

from benchmarks.reliability.cluster import LocalCluster, wait_until
from benchmarks.reliability.load import Load, body
from benchmarks.reliability.result import ScenarioResult
from routing.redis_store import RedisStore

SHARED_AGAIN_WITHIN_S = 10.0
LEASES_RELEASED_WITHIN_S = 5.0
IDLE_WITHIN_S = 15.0
# Abandoned requests ask for up to 1,000 tokens (~4 s of work here): idle well before that
# means the work stopped when the client left.
ABANDONED_IDLE_WITHIN_S = 2.0


def _mixed(i: int) -> dict:
    return body(i, stream=i % 2 == 0, max_tokens=8, prefix="state")


def _redis_state(cluster: LocalCluster) -> list[str]:
    return [cluster.admin(g, "/summary")["redis"]["state"] for g in cluster.gateways]


def redis_restarted(cluster: LocalCluster, before: int = 20, during: int = 20, after: int = 20,
                    workers: int = 4) -> ScenarioResult:
    """With Redis gone the gateways route on local state, so no request fails; once it is back
    they share state again."""
    result = ScenarioResult("Redis killed and restarted")
    redis = cluster.redis
    urls = [g.spec.url for g in cluster.gateways]
    with Load(urls, workers, _mixed) as load:
        load.wait_for(before)
        cluster.kill(redis)
        load.wait_for(load.tally.sent + during)
        result.checks["gateways say they fell back"] = wait_until(
            lambda: set(_redis_state(cluster)) == {"local_fallback"}, 5.0) is not None
        cluster.start([redis])
        back = wait_until(lambda: set(_redis_state(cluster)) == {"shared"}, SHARED_AGAIN_WITHIN_S)
        load.wait_for(load.tally.sent + after)
    result.count(load.tally)
    result.notes["shared_again_after_s"] = None if back is None else round(back, 2)
    result.checks["shared state resumes"] = back is not None
    result.checks["no request fails"] = result.failed == 0
    # a gateway releases a booking after the client has its last byte: give the releases of
    # the last requests a moment to reach Redis
    result.checks["no lease left behind"] = wait_until(lambda: sum(
        _leases(cluster, r.spec.url.removeprefix("http://")) for r in cluster.replicas) == 0,
        LEASES_RELEASED_WITHIN_S) is not None
    return result


def _leases(cluster: LocalCluster, replica: str) -> int:
    """Live leases of `replica` in Redis (bookings of requests still running)."""
    async def read() -> int:
        store = RedisStore(cluster.plan.redis_url, timeout_s=2.0)
        try:
            return await store.in_flight(replica) or 0
        finally:
            await store.close()
    return asyncio.run(read())


def gateway_killed(cluster: LocalCluster, streams: int = 4, max_tokens: int = 1800) -> ScenarioResult:
    """A gateway killed mid-stream leaves no phantom load: its Redis leases expire, the replicas
    abort the requests whose connection died, and the other gateway's view returns to idle."""
    result = ScenarioResult("gateway killed (SIGKILL)")
    victim, survivor = cluster.gateways[0], cluster.gateways[1]
    names = [r.spec.url.removeprefix("http://") for r in cluster.replicas]
    opened: list[httpx.Response] = []
    lines = []  # kept: a dropped line iterator closes its connection
    clients = [httpx.Client() for _ in range(streams)]
    try:
        for i, client in enumerate(clients):
            request = client.build_request("POST", victim.spec.url + "/v1/completions", timeout=30,
                                           json=body(i, True, max_tokens, prefix=f"victim-{i}"))
            r = client.send(request, stream=True)
            opened.append(r)
            lines.append(r.iter_lines())
            next(lines[-1])
        result.checks["streams running"] = all(r.status_code == 200 for r in opened)
        # Paused replicas hold the streams open (a tiny model would finish them at once).
        for replica in cluster.replicas:
            cluster.pause(replica)
        booked = sum(_leases(cluster, n) for n in names)
        result.notes["leases_before_kill"] = booked
        result.checks["streams booked in Redis"] = booked == streams
        cluster.kill(victim)
        for replica in cluster.replicas:
            cluster.resume(replica)
    finally:
        for r in opened:
            r.close()
        for client in clients:
            client.close()
    # Those clients saw their connection die with the gateway: a transport error, not a hang.
    result.notes["streams_cut_by_the_kill"] = streams
    lease_s = cluster.spec.gateway["lease_s"]
    expired = wait_until(lambda: sum(_leases(cluster, n) for n in names) == 0, lease_s + 5.0)
    result.notes["leases_expired_after_s"] = None if expired is None else round(expired, 2)
    result.checks["leases expire"] = expired is not None
    idle = wait_until(lambda: all(
        row["in_flight"] == 0 and row["engine_running"] + row["engine_waiting"] == 0
        for row in cluster.replica_rows(survivor).values()), IDLE_WITHIN_S)
    result.checks["no phantom load on the other gateway"] = idle is not None
    result.checks["replicas abort the orphaned streams"] = all(
        cluster.engine_load(r)["running"] == 0 for r in cluster.replicas)
    result.checks["replicas routable again"] = wait_until(lambda: all(
        row["routable"] for row in cluster.replica_rows(survivor).values()), IDLE_WITHIN_S) is not None
    with Load([survivor.spec.url], 2, _mixed, total=10) as load:
        pass
    result.count(load.tally)
    result.checks["the other gateway serves on"] = result.succeeded == 10
    cluster.start([victim])
    return result


def _leave_before_headers(url: str, payload: dict, rng: random.Random) -> None:
    """Send the request (or part of it) on a raw socket and hang up before any answer."""
    raw = json.dumps(payload).encode()
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(head + raw[: rng.randrange(len(raw) + 1)])
        time.sleep(rng.uniform(0.0, 0.2))


def _leave_mid_stream(client: httpx.Client, url: str, payload: dict, rng: random.Random) -> None:
    with client.stream("POST", url + "/v1/completions", json={**payload, "stream": True}, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= rng.randrange(1, 12):
                return


def _leave_while_waiting(client: httpx.Client, url: str, payload: dict, rng: random.Random) -> None:
    try:
        client.post(url + "/v1/completions", json=payload, timeout=rng.uniform(0.02, 0.3))
    except httpx.TimeoutException:
        pass


def client_disconnects(cluster: LocalCluster, count: int = 30, seed: int = 0) -> ScenarioResult:
    """Clients that hang up before the headers, mid-stream or while waiting for a whole answer:
    afterwards every replica's KV blocks and every gateway's bookings are back to idle."""
    result = ScenarioResult("client disconnects")
    rng = random.Random(seed)
    ways = (_leave_before_headers, _leave_mid_stream, _leave_while_waiting)
    with httpx.Client() as client:
        for i in range(count):
            url = cluster.gateways[i % len(cluster.gateways)].spec.url
            payload = body(i, False, max_tokens=rng.choice((16, 200, 1000)), prefix="leave")
            way = ways[i % len(ways)]
            if way is _leave_before_headers:
                way(url, payload, rng)
            else:
                way(client, url, payload, rng)
    result.sent = count  # every one abandoned by its client: neither succeeded nor failed

    def idle() -> bool:
        engines = [cluster.engine_load(r) for r in cluster.replicas]
        rows = [row for g in cluster.gateways for row in cluster.replica_rows(g).values()]
        return (all(e["running"] + e["waiting"] == 0 and e["num_free_blocks"] == e["num_total_blocks"]
                    for e in engines) and all(row["in_flight"] == 0 for row in rows))

    took = wait_until(idle, ABANDONED_IDLE_WITHIN_S)
    result.notes["idle_after_s"] = None if took is None else round(took, 2)
    result.checks["KV blocks and bookings back to baseline at once"] = took is not None
    if cluster.redis is not None:
        result.checks["no lease left in Redis"] = sum(
            _leases(cluster, r.spec.url.removeprefix("http://")) for r in cluster.replicas) == 0
    return result
