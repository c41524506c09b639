"""Backends that are not kvgate (no /kv endpoints, no /tokenize): the gateway still serves and
routes them, learning each one's cache from routing history (the approximate index)."""

from __future__ import annotations

import httpx
import pytest

from benchmarks.gateway_overhead import FIXTURE_MODEL
from tests.gateway import procs

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def gw():
    upstreams = [procs.fixture_upstream(), procs.fixture_upstream()]
    procs.start_all(upstreams)
    gateway = procs.gateway([u.url for u in upstreams], "--tokenizer", f"{FIXTURE_MODEL}={procs.tokenizer_folder()}")
    gateway.start()
    try:
        yield gateway
    finally:
        for p in (gateway, *upstreams):
            p.stop()


def chat(gw, system: str, user: str) -> httpx.Response:
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
        "model": FIXTURE_MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
    assert r.status_code == 200, r.text
    return r


def test_backends_without_kv_events_use_the_approximate_index(gw):
    assert procs.wait_until(lambda: all(r["index"] == "approximate" for r in procs.admin(gw, "/replicas").json()["data"]))
    rows = procs.admin(gw, "/replicas").json()["data"]
    assert all(r["tokenizer_parity"].startswith("unavailable") for r in rows)  # no /tokenize to compare with


def test_a_repeated_prefix_sticks_to_the_replica_that_saw_it(gw):
    for tag in ("one", "two", "three"):
        system = procs.long_system_prompt(tag)
        first = chat(gw, system, "a").headers["x-kvgate-replica"]
        for i in range(3):
            assert chat(gw, system, f"b{i}").headers["x-kvgate-replica"] == first
        last = procs.admin(gw, "/decisions?limit=1").json()["data"][0]
        assert last["reason"] == "cache_hit" and last["predicted_cached_tokens"] > 100
    # Learned entries stay after the few-second predictions expire: they are resident.
    assert sum(r["index_blocks"] for r in procs.admin(gw, "/replicas").json()["data"]) > 0
