"""Through the gateway, a prefill replica, a decode replica and a `both` replica (real
processes): requests go through the pair and stream exactly what a `both` replica answers;
prefix hits on either side shrink the work; a decode replica that holds the prompt takes it
alone (bypass); the admin API, dashboard data and metrics show roles and transfers."""

import json

import httpx
import pytest

from tests.gateway import procs
from tests.gateway.test_gateway_dashboard import browser  # noqa: F401 - the fixture

MODEL = procs.MODEL


@pytest.fixture(scope="module")
def cluster():
    prefill = procs.replica(None, "--kv-transfer-config", '{"kv_role": "kv_producer", "kv_timeout_s": 2}')
    decode = procs.replica(None, "--kv-transfer-config", '{"kv_role": "kv_consumer", "kv_timeout_s": 2}')
    both = procs.replica()
    gw = procs.gateway([prefill.url, decode.url, both.url])
    names = {"prefill": prefill.url.split("//")[1], "decode": decode.url.split("//")[1],
             "both": both.url.split("//")[1]}
    try:  # stops every process even when one fails to start
        procs.start_all([prefill, decode, both])
        gw.start()
        assert procs.wait_until(lambda: {r["name"]: r["role"] for r in procs.admin(gw, "/replicas").json()["data"]}
                                == {v: k for k, v in names.items()}, 60)
        yield gw, both, names
    finally:
        for p in (gw, prefill, decode, both):
            p.stop()


def chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 16, **extra}


def streamed(url: str, body: dict) -> tuple[str, dict | None, str | None]:
    text, usage = "", None
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        replica = r.headers.get("x-kvgate-replica")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    text += choice["delta"].get("content") or ""
    return text, usage, replica


def last_decision(gw) -> dict:
    return procs.admin(gw, "/decisions?limit=1").json()["data"][0]


def test_a_streamed_request_goes_through_the_pair_and_matches_a_both_replica(cluster):
    gw, both, names = cluster
    body = chat(procs.long_system_prompt("pair", words=160) + " Summarise the rules.")
    expected, _, _ = streamed(both.url, body)
    text, usage, replica = streamed(gw.url, body)
    assert text == expected
    assert replica == names["decode"]
    decision = last_decision(gw)
    assert decision["reason"].startswith("pd_pair") and decision["prefill_replica"] == names["prefill"]
    assert usage["completion_tokens"] == 16


def test_prefix_hits_on_both_sides_shrink_the_work_and_keep_the_output(cluster):
    gw, both, names = cluster
    system = procs.long_system_prompt("shared", words=160)
    streamed(gw.url, chat(system + " First question."))
    before = procs.admin(gw, "/pd").json()["transfer_blocks"]
    body = chat(system + " " + " ".join(f"detail{i} matters here." for i in range(40)))
    expected, _, _ = streamed(both.url, body)
    text, usage, _ = streamed(gw.url, body)
    assert text == expected
    assert last_decision(gw)["reason"].startswith("pd_pair")
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # the prefill side reused the system prompt
    sent = procs.admin(gw, "/pd").json()["transfer_blocks"] - before
    assert 0 < sent < usage["prompt_tokens"] // 16  # the decode side lacked only the new blocks


def test_a_decode_replica_holding_the_prompt_takes_it_alone(cluster):
    gw, both, names = cluster
    body = chat(procs.long_system_prompt("bypass", words=120) + " Again?")
    first, _, _ = streamed(gw.url, body)
    again, _, replica = streamed(gw.url, body)
    assert again == first and replica == names["decode"]
    decision = last_decision(gw)
    assert decision["reason"].startswith("pd_bypass") and decision["prefill_replica"] is None


def test_n_greater_than_one_non_streamed(cluster):
    gw, both, _ = cluster
    body = chat(procs.long_system_prompt("samples", words=120) + " Two answers.", n=2)
    expected = httpx.post(both.url + "/v1/chat/completions", json=body, timeout=60).json()
    got = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert [c["message"]["content"] for c in got["choices"]] == [expected["choices"][0]["message"]["content"]] * 2
    assert last_decision(gw)["reason"].startswith("pd_pair")


def test_several_prompts_are_served_whole_by_the_both_replica(cluster):
    gw, _, names = cluster
    body = {"model": MODEL, "prompt": ["one two three " * 30, "four five six " * 30], "max_tokens": 4}
    r = httpx.post(gw.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert r.headers["x-kvgate-replica"] == names["both"]


def test_admin_api_and_metrics_show_roles_and_transfers(cluster):
    gw, _, names = cluster
    streamed(gw.url, chat(procs.long_system_prompt("metrics", words=120) + " Go."))
    pd = procs.admin(gw, "/pd").json()
    assert pd["decisions"]["pair"] >= 1 and pd["transfer_bytes"] > 0 and pd["transfer_p50_s"] > 0
    assert pd["transfers_in_flight"] == 0 and pd["recent"][-1]["decode"] == names["decode"]
    replicas = {r["name"]: r for r in procs.admin(gw, "/replicas").json()["data"]}
    assert replicas[names["decode"]]["kv_transfer_address"].startswith("tcp://")
    metrics = httpx.get(gw.url + "/metrics").text
    assert "kvgate_gateway_pd_transfer_bytes_total" in metrics
    assert 'kvgate_gateway_pd_decisions_total{kind="pair"}' in metrics


def test_clients_may_not_send_kv_transfer_params(cluster):
    gw, _, _ = cluster
    body = chat("hi", kv_transfer_params={"do_remote_prefill": True, "transfer_id": "x",
                                          "first_tokens": [{"token_id": 1}]})
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"


def test_dashboard_shows_roles_and_the_pd_panel(cluster, browser):
    gw, _, names = cluster
    streamed(gw.url, chat(procs.long_system_prompt("dashboard-pd", words=120) + " Go."))
    page = browser.new_page()
    page.goto(gw.url + "/admin")
    page.fill("#key", procs.ADMIN_KEY)
    page.click("#login-btn")
    page.wait_for_selector("#pd-panel", state="visible", timeout=15_000)
    pd = procs.admin(gw, "/pd").json()
    page.wait_for_function(f"document.getElementById('pd-decisions').textContent.startsWith('{pd['decisions']['pair']} /')",
                           timeout=10_000)
    assert page.text_content("#pd-in-flight") == "0"
    assert page.locator("#pd-transfers tbody tr").count() >= 1
    for role, name in names.items():
        assert page.text_content(f'#replicas tr[data-replica="{name}"] td[data-field="role"]') == role
    assert names["prefill"] + " → " + names["decode"] in page.text_content("#decisions")
    page.close()
