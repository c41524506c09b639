"""A fleet routed through vLLM-format KV events alone: two kvgate replicas publish over ZMQ
(`--kv-events-config`); one gateway follows them through ZMQ only (`--kv-events`: it never
reads their /kv/snapshot or /kv/events), another through the native endpoints. After the same
traffic both hold the same blocks per replica, and both send every follow-up to the replica
that holds its prefix, predicting exactly the cached tokens the replica then reports."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway import procs
from tests.gateway.zmq_publishers import free_ports

pytestmark = pytest.mark.timeout(240)

BS = 16
PREFIX_BLOCKS = 4


def _tokens(group: int, suffix: int) -> list[int]:
    prefix = [(group * 1009 + i * 7) % 30_000 + 1 for i in range(PREFIX_BLOCKS * BS)]
    return prefix + [(suffix * 131 + i * 11) % 30_000 + 1 for i in range(BS + 5)]


def _send(gw: procs.Proc, tokens: list[int]) -> tuple[str, int, dict]:
    r = httpx.post(gw.url + "/v1/completions", timeout=60,
                   json={"model": procs.MODEL, "prompt": tokens, "max_tokens": 1})
    assert r.status_code == 200, r.text
    decision = procs.admin(gw, "/decisions?limit=1").json()["data"][0]
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return r.headers["x-kvgate-replica"], cached, decision


def _blocks(gw: procs.Proc) -> dict[str, int]:
    return {r["url"]: r["index_blocks"] for r in procs.admin(gw, "/replicas").json()["data"]}


def _names(gw: procs.Proc) -> dict[str, str]:
    return {r["name"]: r["url"] for r in procs.admin(gw, "/replicas").json()["data"]}


def test_a_zmq_only_gateway_routes_as_the_native_one():
    ports = free_ports(4)
    replicas = []
    for i in range(2):
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://127.0.0.1:{ports[2 * i]}",
                  "replay_endpoint": f"tcp://127.0.0.1:{ports[2 * i + 1]}"}
        replicas.append(procs.replica(None, "--kv-events-config", json.dumps(config)))
    procs.start_all(replicas)
    zmq_args: list[str] = []
    for i, r in enumerate(replicas):
        zmq_args += ["--replica", r.url, "--kv-events",
                     f"tcp://127.0.0.1:{ports[2 * i]},replay=tcp://127.0.0.1:{ports[2 * i + 1]}"]
    zmq_gw = procs.gateway([], *zmq_args).start()
    native_gw = procs.gateway([r.url for r in replicas]).start()
    try:
        rows = procs.admin(zmq_gw, "/replicas").json()["data"]
        assert all(r["kv_events"] is not None for r in rows), rows
        assert all(r["kv_events"] is None and r["index"] == "exact"
                   for r in procs.admin(native_gw, "/replicas").json()["data"])
        home: dict[int, str] = {}  # prefix group -> URL of the replica that computed it
        for group in range(4):
            name, _, _ = _send(zmq_gw, _tokens(group, 0))
            home[group] = _names(zmq_gw)[name]
        assert len(set(home.values())) == 2  # the groups were spread over both replicas

        def converged() -> bool:
            a, b = _blocks(zmq_gw), _blocks(native_gw)
            return a == b and all(a.values())

        assert procs.wait_until(converged, 15.0), (_blocks(zmq_gw), _blocks(native_gw))
        for group in range(4):
            for gw in (zmq_gw, native_gw):
                name, cached, decision = _send(gw, _tokens(group, 1 + (gw is native_gw)))
                assert _names(gw)[name] == home[group], (group, decision)
                assert decision["predicted_cached_tokens"] == cached >= PREFIX_BLOCKS * BS
    finally:
        for p in (zmq_gw, native_gw, *replicas):
            p.stop()
