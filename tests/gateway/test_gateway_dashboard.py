"""The admin dashboard in a real headless Chromium (Playwright): sign in with the admin key,
see the replicas, send traffic, and watch the page show the same numbers as /admin/api."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from tests.gateway import procs

pytestmark = pytest.mark.timeout(180)
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).with_name("artifacts")


@pytest.fixture(scope="module")
def cluster():
    with procs.two_replicas_and_gateway() as running:
        yield running


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
    if not shutil.which(CHROMIUM) and not os.path.exists(CHROMIUM):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("chromium is not installed (`apt-get install -y chromium`)")
        pytest.skip("chromium is not installed (`apt-get install -y chromium`)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM,
                              args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            yield b
        finally:
            b.close()


def send_traffic(gw, n: int = 6) -> None:
    system = procs.long_system_prompt("dashboard")
    for i in range(n):
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": procs.MODEL, "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]})
        assert r.status_code == 200


def page_matches_api(page, gw) -> bool:
    replicas = procs.admin(gw, "/replicas").json()["data"]
    summary = procs.admin(gw, "/summary").json()
    if page.text_content("#m-requests") != str(summary["requests"]):
        return False
    if page.text_content("#m-saved") != str(summary["prefill_tokens_saved"]):
        return False
    for r in replicas:
        row = f'#replicas tr[data-replica="{r["name"]}"]'
        for field in ("requests", "cached_tokens", "predicted_cached_tokens", "index_blocks"):
            if page.text_content(f'{row} td[data-field="{field}"]') != str(r[field]):
                return False
    return True


def test_dashboard_signs_in_and_shows_live_numbers(cluster, browser):
    _, gw = cluster
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(gw.url + "/admin")
    assert page.is_visible("#login") and not page.is_visible("#app")

    page.fill("#key", "not-the-key")
    page.click("#login-btn")
    page.wait_for_function("document.getElementById('login-err').textContent.length > 0")
    assert not page.is_visible("#app")

    page.fill("#key", procs.ADMIN_KEY)
    page.click("#login-btn")
    page.wait_for_selector("#replicas tbody tr[data-replica]", timeout=10_000)
    assert procs.ADMIN_KEY not in page.url
    assert page.evaluate("sessionStorage.getItem('kvgate-admin-key')") == procs.ADMIN_KEY
    names = {r["name"] for r in procs.admin(gw, "/replicas").json()["data"]}
    shown = set(page.eval_on_selector_all("#replicas tbody tr", "rows => rows.map(r => r.dataset.replica)"))
    assert shown == names
    assert page.text_content("#redis") == "local (no Redis)"

    send_traffic(gw)
    # The page polls every second; once traffic stops it must agree with the API exactly.
    for _ in range(100):
        if page_matches_api(page, gw):
            break
        page.wait_for_timeout(100)
    assert page_matches_api(page, gw)
    summary = procs.admin(gw, "/summary").json()
    assert summary["prefill_tokens_saved"] > 0
    assert page.text_content("#m-ratio") == f"{100 * summary['cached_token_ratio']:.1f}%"
    # Predicted and engine-reported points for the replica that took the traffic.
    assert page.locator("#chart-hit circle").count() >= 2
    assert page.locator("#chart-rate circle").count() >= 1
    assert float(page.text_content("#m-rps")) > 0
    assert page.locator("#decisions tbody tr").count() >= 6
    assert "cache_hit" in page.text_content("#decisions")

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000

    page.click("#logout")
    assert page.is_visible("#login")
    assert page.evaluate("sessionStorage.getItem('kvgate-admin-key')") is None
    page.close()


def test_dashboard_shows_prefix_advice_masked(cluster, browser):
    _, gw = cluster
    stamps = [f"2025-0{i + 1}-1{i} 0{i}:3{i}:5{i}" for i in range(4)]
    rules = procs.long_system_prompt("advice")
    for ts in stamps:
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": procs.MODEL, "max_tokens": 1,
            "messages": [{"role": "system", "content": f"Now: {ts}. {rules}"},
                         {"role": "user", "content": "hi"}]})
        assert r.status_code == 200
    advice = procs.admin(gw, "/prefix_advice").json()["data"]
    assert len(advice) == 1 and advice[0]["active"]
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(gw.url + "/admin")
    page.fill("#key", procs.ADMIN_KEY)
    page.click("#login-btn")
    row = page.wait_for_selector('#prefix-advice tbody tr[data-key="anonymous"]', timeout=10_000)
    assert row.query_selector('[data-field="excerpt"]').text_content() == advice[0]["excerpt"]
    assert "⟦####-##-## ##:##:##⟧" in advice[0]["excerpt"]
    assert row.query_selector('[data-field="saving_tokens_per_request"]').text_content() == str(
        advice[0]["saving_tokens_per_request"])
    assert "active" in row.text_content()
    text = page.text_content("#advice-panel")
    assert not any(piece in text for ts in stamps for piece in ts.split())
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#advice-panel").screenshot(path=str(ARTIFACTS / "prefix_advice.png"))
    page.close()


def test_dashboard_pins_a_prefix_shows_it_per_replica_and_removes_it(cluster, browser):
    _, gw = cluster
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(gw.url + "/admin")
    page.fill("#key", procs.ADMIN_KEY)
    page.click("#login-btn")
    page.wait_for_selector("#pin-model option", state="attached", timeout=10_000)

    page.select_option("#pin-kind", "system")
    page.fill("#pin-text", "too short")
    page.click("#pin-add")
    page.wait_for_function("document.getElementById('pin-err').textContent.includes('full block')")
    assert procs.admin(gw, "/pins").json()["data"] == []

    page.fill("#pin-text", procs.long_system_prompt("dashboard-pin", words=80))
    page.click("#pin-add")
    page.wait_for_selector("#pins tbody tr[data-pin]", timeout=30_000)
    (pin,) = procs.admin(gw, "/pins").json()["data"]
    row = f'#pins tr[data-pin="{pin["id"]}"]'
    assert page.text_content(f'{row} td[data-field="num_blocks"]') == str(pin["num_blocks"])
    assert page.locator(f"{row} .pill", has_text="pinned").count() == 2
    assert "[dashboard-pin]" in page.text_content(f'{row} td[data-field="excerpt"]')
    page.wait_for_function(
        f"document.getElementById('pin-capacity').textContent.includes('{pin['num_blocks']} / ')", timeout=10_000)
    page.locator("#pins-panel").screenshot(path=str(ARTIFACTS / "dashboard-pins.png"))

    page.click(f'{row} button[data-unpin]')
    page.wait_for_selector(row, state="detached", timeout=10_000)
    assert procs.admin(gw, "/pins").json()["data"] == []
    page.close()
