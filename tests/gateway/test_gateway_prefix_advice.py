"""Prefix-stability advice through a real gateway and a tiny replica: a key whose system prompt
starts with a timestamp gets advice (admin API, Prometheus) whose saving the engine confirms
once the field moves to the end; no value leaks; the route needs the admin key."""

from __future__ import annotations

import random
import re

import httpx
import pytest
import yaml

from tests.gateway import procs

pytestmark = pytest.mark.timeout(180)

TEAM_KEY, OTHER_KEY = "sk-team-1", "sk-other-2"
RULES = " ".join(f"Rule {i}: answer politely, cite the policy section and never guess." for i in range(12))


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    config = tmp_path_factory.mktemp("gw") / "gateway.yaml"
    config.write_text(yaml.safe_dump({"api_keys": [{"key": TEAM_KEY, "name": "team"},
                                                   {"key": OTHER_KEY, "name": "other"}]}))
    replica = procs.replica().start()  # one replica: every prompt meets the same cache
    gateway = procs.gateway([replica.url], config=str(config)).start()
    try:
        yield gateway
    finally:
        gateway.stop()
        replica.stop()


def chat(gw, key: str, system: str, user: str = "Where is my parcel?") -> dict:
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": procs.MODEL, "max_tokens": 1,
                         "messages": [{"role": "system", "content": system},
                                      {"role": "user", "content": user}]})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def metric(gw, name: str, key: str) -> float | None:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    found = re.search(rf'^{name}\{{key="{key}",model="{procs.MODEL}"\}} (\S+)$', text, re.M)
    return None if found is None else float(found.group(1))


def stamps(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:"
            f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}" for _ in range(n)]


def test_a_timestamp_first_prompt_gets_advice_the_engine_confirms(gw):
    values = stamps(5, seed=1)
    volatile = [chat(gw, TEAM_KEY, f"Today is {ts} UTC. You are the ACME assistant. {RULES}")
                for ts in values]
    body = procs.admin(gw, "/prefix_advice").json()
    assert body["enabled"] and body["models_without_tokenizer"] == []
    rows = [r for r in body["data"] if r["key"] == "team"]
    assert len(rows) == 1
    row = rows[0]
    assert row["active"] and row["model"] == procs.MODEL and row["kind"] == "timestamp"
    assert row["occurrences"] == 4 and row["excerpt"].startswith("… <|im_start|>system Today is ⟦")
    dump = str(body)
    assert not any(piece in dump for ts in values for piece in ts.split())
    saving = row["saving_tokens_per_request"]
    assert saving >= 10 * 16 and saving % 16 == 0
    # What the engine reported: the cache stopped at the field, every time.
    assert all(u["prompt_tokens_details"]["cached_tokens"] <= row["cached_tokens_now"]
               for u in volatile[1:])
    # The advice taken: the field at the end, and the engine now serves the estimated saving.
    fixed = [chat(gw, TEAM_KEY, f"You are the ACME assistant. {RULES} Today is {ts} UTC.")
             for ts in stamps(2, seed=2)]
    assert fixed[1]["prompt_tokens_details"]["cached_tokens"] >= saving - 16

    assert metric(gw, "kvgate_gateway_prefix_instability_total", "team") == 4
    assert metric(gw, "kvgate_gateway_prefix_instability_wasted_tokens_total", "team") == 4 * saving
    assert metric(gw, "kvgate_gateway_prefix_advice_saving_tokens", "team") == saving


def test_other_keys_and_steady_prompts_get_none(gw):
    system = f"You are the ACME assistant. {RULES}"
    for user in ("Where is my parcel?", "Can I change my plan?", "What are your opening hours?"):
        chat(gw, OTHER_KEY, system, user)
    chat(gw, OTHER_KEY, system)
    body = procs.admin(gw, "/prefix_advice").json()
    assert [r for r in body["data"] if r["key"] == "other"] == []
    assert metric(gw, "kvgate_gateway_prefix_instability_total", "other") is None


def test_bad_token_ids_do_not_disturb_the_gateway(gw):
    before = procs.admin(gw, "/prefix_advice").json()["data"]
    for prompt in ([1, 2, 2**40], [1, 2, 10**7]):  # beyond 32 bits; beyond the vocabulary
        r = httpx.post(gw.url + "/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {TEAM_KEY}"},
                       json={"model": procs.MODEL, "prompt": prompt, "max_tokens": 1})
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert procs.admin(gw, "/prefix_advice").json()["data"] == before


def test_the_advice_route_needs_the_admin_key(gw):
    assert httpx.get(gw.url + "/admin/api/prefix_advice").status_code == 401
    r = httpx.get(gw.url + "/admin/api/prefix_advice", headers={"Authorization": f"Bearer {TEAM_KEY}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    body = procs.admin(gw, "/prefix_advice").json()
    assert {"enabled", "data", "models_without_tokenizer", "tracked", "prompts_kept", "prompt_bytes",
            "min_occurrences", "window_prompts", "block_size"} <= set(body)


def test_advice_can_be_switched_off():
    from starlette.testclient import TestClient

    from gateway.app import create_app
    from gateway.config import GatewayConfig

    with TestClient(create_app(GatewayConfig(admin_key="adm", prefix_advice=False))) as client:
        r = client.get("/admin/api/prefix_advice", headers={"Authorization": "Bearer adm"})
        assert r.status_code == 200 and r.json() == {"enabled": False, "data": [],
                                                     "models_without_tokenizer": []}
        assert "prefix_advice_saving_tokens{" not in client.get("/metrics").text
