"""Kill a replica process during a run: requests that have not started streaming succeed on the
other replica, a stream cut mid-way ends with an OpenAI error event (migration off here), the
replica is marked down, and when it comes back on its port it is routable again with its index
rebuilt."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from tests.gateway import procs

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = tmp_path_factory.mktemp("gw") / "gateway.yaml"
    # Slow active checks, so the first requests after a kill meet the dead replica themselves;
    # no migration: a cut stream ends (test_gateway_migration.py continues them).
    config.write_text(yaml.safe_dump({"health_interval_s": 2.0, "failure_threshold": 2,
                                      "circuit_cooldown_s": 1.0, "max_attempts": 3,
                                      "migration_limit": 0}))
    replicas = [procs.replica(), procs.replica()]
    procs.start_all(replicas)
    gw = procs.gateway([r.url for r in replicas], config=str(config)).start()
    try:
        yield replicas, gw
    finally:
        for p in (gw, *replicas):
            p.stop()


def chat(gw, system: str, user: str) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": procs.MODEL, "max_tokens": 3,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})


def rows(gw) -> dict[str, dict]:
    return {r["name"]: r for r in procs.admin(gw, "/replicas").json()["data"]}


def metric(gw, name: str) -> float:
    total = 0.0
    for line in httpx.get(gw.url + "/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_stream_cut_mid_way_ends_with_an_error_event(cluster):
    replicas, gw = cluster
    body = {"model": procs.MODEL, "prompt": "tell me", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        victim = next(p for p in replicas if p.url == "http://" + r.headers["x-kvgate-replica"])
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        victim.kill()
        rest = [line for line in lines if line.startswith("data: ")]
    error = json.loads(rest[-2][6:])
    assert error["error"]["code"] == "upstream_error" and rest[-1] == "data: [DONE]"
    victim.start()  # back for the next test
    assert procs.wait_until(lambda: rows(gw)[r.headers["x-kvgate-replica"]]["routable"], 15)


def test_requests_not_yet_streaming_fail_over_and_the_replica_comes_back(cluster):
    replicas, gw = cluster
    system = procs.long_system_prompt("failover")
    first = chat(gw, system, "warm")
    holder_name = first.headers["x-kvgate-replica"]
    holder = next(p for p in replicas if p.url == "http://" + holder_name)
    assert rows(gw)[holder_name]["index_blocks"] > 0 or procs.wait_until(lambda: rows(gw)[holder_name]["index_blocks"] > 0)
    retries_before = metric(gw, "kvgate_gateway_retries_total")

    holder.kill()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: chat(gw, system, f"after kill {i}"), range(8)))
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
    assert all(a.headers["x-kvgate-replica"] != holder_name for a in answers)
    assert metric(gw, "kvgate_gateway_retries_total") > retries_before
    failed = [d for d in procs.admin(gw, "/decisions?limit=50").json()["data"]
              if d["replica"] == holder_name and d["error"]]
    assert failed, "the dead holder was tried first (it holds the prefix) and failed over"

    assert procs.wait_until(lambda: rows(gw)[holder_name]["status"] == "down", 10)
    assert not rows(gw)[holder_name]["routable"]
    assert httpx.get(gw.url + "/health").json()["routable"] == [n for n in rows(gw) if n != holder_name]

    holder.start()
    assert procs.wait_until(lambda: rows(gw)[holder_name]["routable"] and rows(gw)[holder_name]["kv_connected"], 20)
    # Rebuilt from the restarted engine's snapshot: its old blocks are gone from the index.
    snapshot = httpx.get(holder.url + "/kv/snapshot").json()
    assert rows(gw)[holder_name]["index_blocks"] == len(snapshot["blocks"]) == 0
    # And it takes traffic again: a fresh prefix goes to the least loaded, either replica.
    seen = {chat(gw, procs.long_system_prompt(f"back{i}"), "x").headers["x-kvgate-replica"] for i in range(6)}
    assert holder_name in seen
