"""Request priority through a real gateway and replica: a key's default priority is applied and
forwarded, its bound is a 400, the routed priority shows in decisions, the admin API and
metrics; keys from the config file and from Redis carry priority settings."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import redis.asyncio as aioredis
import yaml
from starlette.requests import Request

from gateway.auth import KeyStore
from gateway.config import ConfigError, GatewayConfig, load_file
from protocol.errors import APIError
from tests.gateway import procs
from tests.routing.conftest import RedisServer

pytestmark = pytest.mark.timeout(180)
BATCH_KEY, CHAT_KEY = "sk-batch-1", "sk-chat-2"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = tmp_path_factory.mktemp("gw") / "gateway.yaml"
    config.write_text(yaml.safe_dump({"api_keys": [
        {"key": BATCH_KEY, "name": "batch", "priority": 7, "max_priority": 5},
        {"key": CHAT_KEY, "name": "chat"},
    ]}))
    replica = procs.replica().start()
    gateway = procs.gateway([replica.url], config=str(config)).start()
    try:
        yield replica, gateway
    finally:
        gateway.stop()
        replica.stop()


def post(gw, key: str, **extra) -> httpx.Response:
    body = {"model": procs.MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            **extra}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})


def replica_ttft_count(replica, priority: str) -> float:
    name = f'kvgate_time_to_first_token_by_priority_seconds_count{{priority="{priority}"}}'
    for line in httpx.get(replica.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_keys_default_priority_is_applied_and_forwarded(cluster):
    replica, gw = cluster
    before = replica_ttft_count(replica, "7")
    r = post(gw, BATCH_KEY)
    assert r.status_code == 200, r.text
    assert procs.wait_until(lambda: replica_ttft_count(replica, "7") == before + 1)
    decision = procs.admin(gw, "/decisions?limit=1").json()["data"][0]
    assert decision["priority"] == 7


def test_a_request_may_ask_for_any_priority_within_its_keys_bound(cluster):
    replica, gw = cluster
    before = replica_ttft_count(replica, "5")
    assert post(gw, BATCH_KEY, priority=5).status_code == 200
    assert post(gw, BATCH_KEY, priority=30).status_code == 200
    assert procs.wait_until(lambda: replica_ttft_count(replica, "5") == before + 1)
    assert post(gw, CHAT_KEY, priority=-3).status_code == 200  # no bound on this key


def test_asking_beyond_the_keys_bound_is_a_400_and_reaches_no_replica(cluster):
    replica, gw = cluster
    before = replica_ttft_count(replica, "0")
    r = post(gw, BATCH_KEY, priority=0)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "priority" and error["code"] == "invalid_value"
    assert "5" in error["message"]
    assert replica_ttft_count(replica, "0") == before


@pytest.mark.parametrize("value", ["high", 1.0, True, 2**31])
def test_a_malformed_priority_is_a_400_at_the_gateway(cluster, value):
    _, gw = cluster
    r = post(gw, CHAT_KEY, priority=value)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_admin_api_and_metrics_show_requests_by_priority(cluster):
    _, gw = cluster
    assert post(gw, BATCH_KEY).status_code == 200
    body = procs.admin(gw, "/priorities").json()
    rows = {row["priority"]: row for row in body["data"]}
    assert rows["7"]["requests"] >= 1 and rows["7"]["ttft_p50_s"] > 0
    assert rows["7"]["in_flight"] == 0
    assert {"name": "batch", "priority": 7, "max_priority": 5} in body["keys"]
    metrics = httpx.get(gw.url + "/metrics", timeout=10).text
    assert 'kvgate_gateway_requests_by_priority_total{priority="7"}' in metrics
    assert 'kvgate_gateway_time_to_first_token_by_priority_seconds_count{priority="7"}' in metrics


@pytest.mark.parametrize("entry,message", [
    ({"priority": "low"}, "integer"),
    ({"priority": True}, "integer"),
    ({"priority": 2**40}, "integer"),
    ({"priority": 0, "max_priority": 3}, "more urgent"),
    ({"urgency": 1}, "unknown fields"),
])
def test_bad_key_priority_settings_are_refused_at_start_up(tmp_path, entry, message):
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump({"api_keys": [{"key": "k", "name": "n", **entry}]}))
    with pytest.raises(ConfigError, match=message):
        load_file(path, GatewayConfig())


def _request(token: str) -> Request:
    return Request({"type": "http", "headers": [(b"authorization", f"Bearer {token}".encode())]})


async def test_keys_stored_in_redis_carry_their_priority():
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(binary)
    server.start()
    client = aioredis.Redis.from_url(server.url, decode_responses=True)
    try:
        await client.hset("kvgate:keys", mapping={
            "sk-r-batch": json.dumps({"name": "r-batch", "priority": 9, "max_priority": 4}),
            "sk-r-bad": json.dumps({"name": "r-bad", "priority": "urgent"})})
        store = KeyStore([], "admin", client)
        key = await store.user(_request("sk-r-batch"))
        assert (key.name, key.priority, key.max_priority) == ("r-batch", 9, 4)
        with pytest.raises(APIError) as err:  # a malformed entry is no key at all
            await store.user(_request("sk-r-bad"))
        assert err.value.status_code == 401
    finally:
        await client.aclose()
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)
