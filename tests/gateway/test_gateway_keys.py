"""API keys against a real gateway and replica: 401 without a key, 403 for a user key on the
admin API, 429 with Retry-After over a key's limits, and per-key cache namespaces."""

from __future__ import annotations

import time

import httpx
import pytest
import yaml

from tests.gateway import procs

pytestmark = pytest.mark.timeout(180)

KEYS = {"alice": "sk-alice-1", "bob": "sk-bob-2", "carol": "sk-carol-3", "rpm": "sk-rpm-4", "tpm": "sk-tpm-5"}


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    config = tmp_path_factory.mktemp("gw") / "gateway.yaml"
    config.write_text(yaml.safe_dump({"api_keys": [
        {"key": KEYS["alice"], "name": "alice", "isolate_cache": True},
        {"key": KEYS["bob"], "name": "bob", "isolate_cache": True},
        {"key": KEYS["carol"], "name": "carol"},
        {"key": KEYS["rpm"], "name": "rpm", "rpm": 3},
        {"key": KEYS["tpm"], "name": "tpm", "tpm": 400},
    ]}))
    # One replica, so a missing hit can only mean a different namespace.
    replica = procs.replica().start()
    gateway = procs.gateway([replica.url], config=str(config)).start()
    try:
        yield gateway
    finally:
        gateway.stop()
        replica.stop()


def post(gw, key: str | None, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(gw.url + path, json=body, headers=headers, timeout=60)


def chat_body(system: str, user: str = "hi") -> dict:
    return {"model": procs.MODEL, "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def inside_one_window(seconds: float = 15.0) -> None:
    """The limits count per clock minute (fixed windows, as the gateway's limiter does): wait
    for the next minute when fewer than `seconds` are left, so that requests meant to share a
    window do."""
    left = 60.0 - time.time() % 60.0
    if left < seconds:
        time.sleep(left + 0.2)


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_missing_or_wrong_key_is_401(gw):
    for key in (None, "sk-wrong"):
        r = post(gw, key, chat_body("x"))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(gw.url + "/v1/models").status_code == 401
    assert httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {KEYS['carol']}"}).status_code == 200


def test_admin_api_needs_the_admin_key(gw):
    assert httpx.get(gw.url + "/admin/api/replicas").status_code == 401
    r = httpx.get(gw.url + "/admin/api/replicas", headers={"Authorization": f"Bearer {KEYS['alice']}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert procs.admin(gw, "/replicas").status_code == 200
    # The page itself carries no data and no key: it asks for the key.
    page = httpx.get(gw.url + "/admin")
    assert page.status_code == 200 and "admin key" in page.text and procs.ADMIN_KEY not in page.text


def test_requests_per_minute_limit_answers_429_with_retry_after(gw):
    inside_one_window()
    codes = [post(gw, KEYS["rpm"], chat_body("rpm")).status_code for _ in range(3)]
    assert codes == [200, 200, 200]
    r = post(gw, KEYS["rpm"], chat_body("rpm"))
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.json()["error"]["type"] == "requests"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    # Other keys are not affected.
    assert post(gw, KEYS["carol"], chat_body("rpm")).status_code == 200


def test_tokens_per_minute_limit(gw):
    inside_one_window()
    small = post(gw, KEYS["tpm"], chat_body("short"))
    assert small.status_code == 200
    big = post(gw, KEYS["tpm"], chat_body(procs.long_system_prompt("tpm")))
    assert big.status_code == 429 and big.json()["error"]["type"] == "tokens"


def test_isolated_keys_never_hit_each_others_cache(gw):
    system = procs.long_system_prompt("tenant")
    assert cached(post(gw, KEYS["alice"], chat_body(system, "a1"))) == 0
    assert cached(post(gw, KEYS["alice"], chat_body(system, "a2"))) > 100  # her own prefix hits
    assert cached(post(gw, KEYS["bob"], chat_body(system, "b1"))) == 0  # same replica, same text
    assert cached(post(gw, KEYS["carol"], chat_body(system, "c1"))) == 0  # shared namespace differs too
    assert cached(post(gw, KEYS["bob"], chat_body(system, "b2"))) > 100
    last = procs.admin(gw, "/decisions?limit=1").json()["data"][0]
    assert last["predicted_cached_tokens"] == procs.whole_blocks(last["engine_cached_tokens"])
    # A client-chosen cache_salt cannot reach another tenant's namespace either.
    assert cached(post(gw, KEYS["carol"], {**chat_body(system, "a3"), "cache_salt": "tenant:alice"})) == 0
