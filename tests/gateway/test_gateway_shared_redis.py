"""Two gateway processes sharing a real redis-server: one capacity budget (never double-booked),
one prefix placement, one rate-limit budget, keys read from Redis."""

from __future__ import annotations

import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
import yaml

from tests.gateway import procs
from tests.routing.conftest import RedisServer

pytestmark = pytest.mark.timeout(180)
KEY, LIMITED = "sk-shared-1", "sk-shared-rpm"
CAPACITY = 2  # per replica, across both gateways


@pytest.fixture(scope="module")
def shared_redis():
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (`apt-get install -y redis-server`)")
    server = RedisServer(binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, shared_redis):
    server = shared_redis
    client = redis.Redis.from_url(server.url, decode_responses=True)
    client.hset("kvgate:keys", mapping={KEY: json.dumps({"name": "shared"}),
                                        LIMITED: json.dumps({"name": "limited", "rpm": 2})})
    config = tmp_path_factory.mktemp("gw") / "gateway.yaml"
    config.write_text(yaml.safe_dump({"redis_keys": True, "max_in_flight": CAPACITY}))
    replicas = [procs.replica(), procs.replica()]
    procs.start_all(replicas)
    urls = [r.url for r in replicas]
    gateways = [procs.gateway(urls, "--redis-url", server.url, config=str(config)) for _ in range(2)]
    procs.start_all(gateways)
    try:
        yield replicas, gateways
    finally:
        for p in (*gateways, *replicas):
            p.stop()
        client.close()


def post(gw, body: dict, key: str = KEY) -> httpx.Response:
    return httpx.post(gw.url + body.pop("_path", "/v1/chat/completions"), json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})


def chat(system: str, user: str, max_tokens: int = 3) -> dict:
    return {"model": procs.MODEL, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def test_both_gateways_say_state_is_shared(cluster):
    _, gateways = cluster
    for gw in gateways:
        assert procs.admin(gw, "/summary").json()["redis"] == {"configured": True, "state": "shared"}
        assert 'kvgate_gateway_redis_state{state="shared"} 1.0' in httpx.get(gw.url + "/metrics").text


def test_prefix_sent_through_a_routes_to_the_same_replica_through_b(cluster):
    _, (a, b) = cluster
    for i in range(4):
        system = procs.long_system_prompt(f"shared{i}")
        first = post(a, chat(system, "via a"))
        second = post(b, chat(system, "via b"))
        assert first.status_code == second.status_code == 200
        assert second.headers["x-kvgate-replica"] == first.headers["x-kvgate-replica"]
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_concurrent_load_through_both_gateways_never_double_books(cluster):
    replicas, gateways = cluster
    peak = {r.url: 0 for r in replicas}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            for r in replicas:
                load = httpx.get(r.url + "/kv/snapshot", timeout=5).json()["load"]
                peak[r.url] = max(peak[r.url], load["running"] + load["waiting"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    body = {"_path": "/v1/completions", "model": procs.MODEL, "max_tokens": 500, "ignore_eos": True}
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: post(gateways[i % 2], {**body, "prompt": f"job {i}"}), range(8)))
    finally:
        stop.set()
        watcher.join()
    codes = sorted(a.status_code for a in answers)
    assert codes.count(200) == CAPACITY * len(replicas), codes
    assert set(codes) == {200, 503}
    assert all(p <= CAPACITY for p in peak.values()), peak
    # Everything released: once the engines' idle heartbeats have reached both gateways (the
    # engine's own count is a floor for the shared one), both can book again.
    for gw in gateways:
        assert procs.wait_until(lambda: all(r["engine_running"] + r["engine_waiting"] == 0
                                            for r in procs.admin(gw, "/replicas").json()["data"]), 5)
        assert all(r["in_flight"] == 0 for r in procs.admin(gw, "/replicas").json()["data"])
    for gw in gateways:
        assert post(gw, chat("after", "again")).status_code == 200


def test_keys_and_rate_limits_come_from_redis_and_are_shared(cluster):
    _, (a, b) = cluster
    assert post(a, chat("rl", "1"), LIMITED).status_code == 200
    assert post(b, chat("rl", "2"), LIMITED).status_code == 200
    over = post(a, chat("rl", "3"), LIMITED)
    assert over.status_code == 429 and "retry-after" in over.headers
    assert post(b, chat("rl", "4"), "sk-not-in-redis").status_code == 401


def test_redis_down_keeps_serving_on_local_state(cluster, shared_redis):
    _, (a, b) = cluster
    redis_server = shared_redis
    redis_server.stop()
    try:
        for gw in (a, b):
            r = post(gw, chat(procs.long_system_prompt("no-redis"), "still here"))
            assert r.status_code == 200  # a key Redis vouched for keeps working
            assert procs.admin(gw, "/summary").json()["redis"]["state"] == "local_fallback"
            assert 'kvgate_gateway_redis_state{state="local_fallback"} 1.0' in httpx.get(gw.url + "/metrics").text
    finally:
        redis_server.start()
    # This throwaway server keeps nothing on disk: put the keys back, as a persistent one would have.
    with redis.Redis.from_url(redis_server.url, decode_responses=True) as client:
        client.hset("kvgate:keys", mapping={KEY: json.dumps({"name": "shared"})})
    assert procs.wait_until(lambda: post(a, chat("back", "x")).status_code == 200
                            and procs.admin(a, "/summary").json()["redis"]["state"] == "shared", 10)
