"""kvgate replicas publishing vLLM-format KV events on ZMQ (`--kv-events-config`): a gateway that
follows only those streams (two of them, sharing Redis, configured from a config file) routes
exactly as one that follows the native /kv/events: the same holders, the same predicted cached
tokens (equal to the engines'), the same index contents."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import yaml

from tests.gateway import procs
from tests.gateway.zmq_publishers import free_ports
from tests.routing.conftest import RedisServer

pytestmark = pytest.mark.timeout(240)


def publishing_replica(port: int, replay: int) -> procs.Proc:
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay}"}
    proc = procs.replica()
    proc.args += ["--kv-events-config", json.dumps(config)]
    return proc


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (`apt-get install -y redis-server`)")
    redis = RedisServer(binary)
    redis.start()
    ports = free_ports(4)
    replicas = [publishing_replica(ports[0], ports[1]), publishing_replica(ports[2], ports[3])]
    procs.start_all(replicas)
    config = tmp_path_factory.mktemp("gw") / "gateway.yaml"
    config.write_text(yaml.safe_dump({"seed": 7, "replicas": [
        {"url": r.url, "kv_events": f"tcp://127.0.0.1:{ports[2 * i]},replay=tcp://127.0.0.1:{ports[2 * i + 1]}"}
        for i, r in enumerate(replicas)]}))
    native = procs.gateway([r.url for r in replicas])
    zmq_gateways = [procs.gateway([], "--redis-url", redis.url, config=str(config)) for _ in range(2)]
    procs.start_all([native, *zmq_gateways])
    try:
        yield replicas, native, zmq_gateways
    finally:
        for p in (native, *zmq_gateways, *replicas):
            p.stop()
        redis.stop()
        shutil.rmtree(redis.dir, ignore_errors=True)


def rows(gw) -> dict[str, dict]:
    return {r["url"]: r for r in procs.admin(gw, "/replicas").json()["data"]}


def chat(gw, system: str, user: str, salt: str | None = None) -> tuple[str, int, int, int]:
    body = {"model": procs.MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]}
    if salt:
        body["cache_salt"] = salt
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    decision = procs.admin(gw, "/decisions?limit=1").json()["data"][0]
    url = next(u for u, x in rows(gw).items() if x["name"] == r.headers["x-kvgate-replica"])
    usage = r.json()["usage"]
    return url, decision["predicted_cached_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def settled(gateways) -> bool:
    """Every gateway's index holds the same blocks per replica (events have landed)."""
    views = [{u: r["index_blocks"] for u, r in rows(gw).items()} for gw in gateways]
    return all(v == views[0] for v in views)


def test_zmq_only_gateways_route_as_the_native_one(fleet):
    replicas, native, zmq_gateways = fleet
    gateways = [native, *zmq_gateways]
    for gw in zmq_gateways:
        assert procs.wait_until(lambda: all(r["index_mode"] == "exact (zmq)" for r in rows(gw).values()), 30)
    assert all(r["index_mode"] == "exact (kvgate)" for r in rows(native).values())
    families = [(procs.long_system_prompt(f"fleet-{i}"), "tenant-x" if i == 2 else None) for i in range(4)]
    holders: dict[int, str] = {}
    hits = {gw.url: [0, 0] for gw in gateways}  # engine-cached and prompt tokens after turn 0
    for turn in range(2):
        for i, (system, salt) in enumerate(families):
            for g, gw in enumerate(gateways):
                user = f"{('alpha', 'bravo', 'charlie')[g]} asks question {turn}"
                where, predicted, cached, prompt = chat(gw, system, user, salt)
                holders.setdefault(i, where)
                assert where == holders[i], f"family {i} left its holder through {gw.url}"
                # the index knew exactly what the engine had (in whole blocks)
                assert predicted == procs.whole_blocks(cached)
                if turn:
                    hits[gw.url][0] += cached
                    hits[gw.url][1] += prompt
                assert procs.wait_until(lambda: settled(gateways), 10)
    assert len(set(holders.values())) == 2  # the families were spread over both replicas
    rate = {url: c / p for url, (c, p) in hits.items()}
    assert rate[native.url] > 0.5
    for gw in zmq_gateways:
        assert abs(rate[gw.url] - rate[native.url]) < 0.03, rate
        assert all(r["kv_events"]["bad_messages"] == 0 and r["kv_events"]["blocks"]["unknown_parent"] == 0
                   for r in rows(gw).values())
