"""Security of a gateway with keys configured: every `/v1/*` operation of its OpenAPI document
refuses a missing or wrong key (401), every admin operation refuses a user key (403), tenants
with their own cache namespace never hit each other's prefix, and neither keys nor prompts nor
completions appear in any process's log or on the dashboard."""

from __future__ import annotations

import secrets

import httpx

from benchmarks.reliability.cluster import MODEL, ClusterSpec, LocalCluster
from benchmarks.reliability.result import ScenarioResult
from protocol.anthropic_errors import is_anthropic_path

ALICE, BOB, CAROL = (f"sk-{name}-{secrets.token_hex(12)}" for name in ("alice", "bob", "carol"))
BAD_AUTHORIZATIONS = ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Bearer"},
                      {"Authorization": f"Basic {ALICE}"}, {"Authorization": f"Bearer {ALICE}x"},
                      {"Authorization": ALICE})


def secured_spec() -> ClusterSpec:
    keys = [{"key": ALICE, "name": "alice", "isolate_cache": True},
            {"key": BOB, "name": "bob", "isolate_cache": True},
            {"key": CAROL, "name": "carol"}]
    return ClusterSpec(replicas=1, gateways=1, redis=False, api_keys=keys)


def _operations(gateway_url: str, prefix: str) -> list[tuple[str, str]]:
    doc = httpx.get(gateway_url + "/openapi.json", timeout=10).json()
    return [(method.upper(), path.replace("{model}", MODEL).replace("{name}", "x"))
            for path, methods in doc["paths"].items() if path.startswith(prefix)
            for method in methods]


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _chat(client: httpx.Client, url: str, key: str, system: str, user: str) -> httpx.Response:
    return client.post(url + "/v1/chat/completions", headers=_bearer(key), timeout=60, json={
        "model": MODEL, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})


def _cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] if r.status_code == 200 else -1


def _refused_key(r: httpx.Response, path: str) -> bool:
    """A 401 body in the API's own shape: Anthropic's on its paths, else OpenAI's."""
    error = r.json()["error"]
    if is_anthropic_path(path):
        return error["type"] == "authentication_error"
    return error.get("code") == "invalid_api_key"


def security(cluster: LocalCluster) -> ScenarioResult:
    result = ScenarioResult("keys, tenants, logs")
    url = cluster.gateways[0].spec.url
    wrong: list[str] = []
    with httpx.Client() as client:
        for method, path in _operations(url, "/v1/"):
            for headers in BAD_AUTHORIZATIONS:
                result.sent += 1
                r = client.request(method, url + path, headers=headers, json={}, timeout=30)
                if r.status_code != 401 or not _refused_key(r, path):
                    wrong.append(f"{method} {path} {sorted(headers.values())}: {r.status_code}")
        for method, path in _operations(url, "/admin/api"):
            for headers, status in ((_bearer(ALICE), 403), (_bearer(CAROL), 403), ({}, 401)):
                result.sent += 1
                r = client.request(method, url + path, headers=headers, json={}, timeout=30)
                if r.status_code != status:
                    wrong.append(f"{method} {path} as {headers or 'nobody'}: {r.status_code}, expected {status}")
        result.checks["401 without a valid key, 403 for a user key on admin routes"] = not wrong
        result.notes["wrong_statuses"] = wrong[:10]

        # Tenant isolation: a prefix Alice sent is cached for her and invisible to Bob and Carol.
        marker = f"secret system prompt {secrets.token_hex(8)} " + "keep it private. " * 30
        completion = _chat(client, url, ALICE, marker, "first")
        hits = [_cached(_chat(client, url, ALICE, marker, "again")),
                _cached(_chat(client, url, BOB, marker, "probe")),
                _cached(_chat(client, url, CAROL, marker, "probe"))]
        result.sent += 4
        result.succeeded = result.sent - len(wrong)
        result.notes["cached_tokens_alice_bob_carol"] = hits
        result.checks["a tenant's prefix gives other keys zero cached tokens"] = hits[0] > 0 and hits[1:] == [0, 0]

        dashboard = client.get(url + "/admin", timeout=10).text + "".join(
            client.get(url + "/admin/api" + path, headers=_bearer(cluster.admin_key), timeout=10).text
            for path in ("/replicas", "/decisions?limit=100", "/summary", "/timeseries"))
    secrets_seen = [name for name, key in (("alice", ALICE), ("bob", BOB), ("carol", CAROL),
                                           ("admin", cluster.admin_key)) if key in dashboard]
    result.checks["no key on the dashboard or admin API"] = not secrets_seen
    logs = cluster.logs()
    in_logs = [name for name, key in (("alice", ALICE), ("bob", BOB), ("carol", CAROL),
                                      ("admin", cluster.admin_key)) if key in logs]
    result.notes["keys_in_logs"] = in_logs
    result.checks["no key in any log"] = not in_logs
    text = completion.json()["choices"][0]["message"]["content"] if completion.status_code == 200 else ""
    result.checks["prompts and completions not logged"] = (
        marker[:40] not in logs and "secret system prompt" not in logs and (len(text) < 8 or text not in logs))
    return result
