"""Pins through the gateway's admin API: a pin reaches every replica serving its model, shows per
replica with capacity, survives a replica restart (re-warmed), and is removed everywhere; bad
input gets OpenAI errors and stores nothing."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway import procs

pytestmark = pytest.mark.timeout(300)
SYSTEM = procs.long_system_prompt("pinned", words=120)


@pytest.fixture(scope="module")
def cluster():
    with procs.two_replicas_and_gateway() as (replicas, gw):
        yield replicas, gw


def replica_pins(replica: procs.Proc) -> list[str]:
    try:
        return [p["id"] for p in httpx.get(replica.url + "/admin/pins", timeout=5).json()["data"]]
    except httpx.HTTPError:
        return []


def cached_tokens(replica: procs.Proc, system: str, user: str) -> int:
    response = httpx.post(replica.url + "/v1/chat/completions", timeout=60, json={
        "model": procs.MODEL, "max_tokens": 1,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_pin_reaches_every_replica_and_is_rewarmed_after_a_restart(cluster):
    replicas, gw = cluster
    created = procs.admin(gw, "/pins", "POST", json={
        "model": procs.MODEL, "messages": [{"role": "system", "content": SYSTEM}]})
    assert created.status_code == 200, created.text
    pin = created.json()
    assert pin["id"].startswith("gw-") and pin["num_blocks"] > 0
    assert {o["state"] for o in pin["replicas"].values()} == {"pinned"}
    assert len(pin["replicas"]) == 2 and "[pinned]" in pin["excerpt"]
    assert all(replica_pins(r) == [pin["id"]] for r in replicas)

    listing = procs.admin(gw, "/pins").json()
    assert [p["id"] for p in listing["data"]] == [pin["id"]]
    assert procs.wait_until(lambda: all(
        r["pinned_blocks"] == pin["num_blocks"] for r in procs.admin(gw, "/pins").json()["replicas"]), 10)
    assert "kvgate_gateway_pinned_prefixes 1.0" in httpx.get(gw.url + "/metrics").text

    victim = replicas[0]
    victim.kill()
    victim.start()  # an empty cache and no pins, until the gateway re-pushes
    assert procs.wait_until(lambda: replica_pins(victim) == [pin["id"]], 60)
    assert cached_tokens(victim, SYSTEM, "hello") >= pin["num_blocks"] * 16

    assert procs.admin(gw, f"/pins/{pin['id']}", "DELETE").json() == {"id": pin["id"], "deleted": True}
    assert all(replica_pins(r) == [] for r in replicas)
    assert procs.admin(gw, "/pins").json()["data"] == []


@pytest.mark.parametrize("body, status, code", [
    ({"model": "no-such-model", "prompt": SYSTEM}, 404, "model_not_found"),
    ({"model": procs.MODEL, "prompt": "too short"}, 400, "invalid_value"),
    ({"model": procs.MODEL, "prompt": ""}, 400, "invalid_value"),
    ({"model": procs.MODEL, "token_ids": [1] * 5000}, 400, "context_length_exceeded"),
    ({"model": procs.MODEL, "token_ids": list(range(16 * 70))}, 400, "pinned_capacity_exceeded"),
])
def test_bad_pins_get_openai_errors_and_store_nothing(cluster, body, status, code):
    _, gw = cluster
    response = procs.admin(gw, "/pins", "POST", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    assert procs.admin(gw, "/pins").json()["data"] == []


def test_pins_need_the_admin_key_and_unknown_ids_are_404(cluster):
    _, gw = cluster
    anonymous = httpx.get(gw.url + "/admin/api/pins", timeout=5)
    assert anonymous.status_code == 401
    assert procs.admin(gw, "/pins/gw-nope", "DELETE").status_code == 404
