"""The dashboard's priority panel in a real headless Chromium: after traffic at two priorities it
shows one row per class, most urgent first, with the same counts as /admin/api/priorities."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway import procs
from tests.gateway.test_gateway_dashboard import browser  # noqa: F401 - the Chromium fixture

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def gw():
    replica = procs.replica().start()
    gateway = procs.gateway([replica.url]).start()
    try:
        yield gateway
    finally:
        gateway.stop()
        replica.stop()


def test_priority_panel_shows_requests_by_class(gw, browser):  # noqa: F811
    for priority, n in ((3, 2), (-1, 1)):
        for _ in range(n):
            r = httpx.post(gw.url + "/v1/completions", timeout=60, json={
                "model": procs.MODEL, "prompt": "hi", "max_tokens": 2, "priority": priority})
            assert r.status_code == 200
    page = browser.new_page()
    page.goto(gw.url + "/admin")
    page.fill("#key", procs.ADMIN_KEY)
    page.click("#login-btn")
    page.wait_for_selector('#priorities tbody tr[data-priority="3"]', timeout=10_000)
    shown = page.eval_on_selector_all("#priorities tbody tr", "rows => rows.map(r => r.dataset.priority)")
    assert shown == ["-1", "3"]
    api = {row["priority"]: row for row in procs.admin(gw, "/priorities").json()["data"]}
    for priority in shown:
        cell = page.text_content(f'#priorities tr[data-priority="{priority}"] td[data-field="requests"]')
        assert cell == str(api[priority]["requests"])
    assert api["3"]["requests"] == 2 and api["-1"]["requests"] == 1
    page.close()
