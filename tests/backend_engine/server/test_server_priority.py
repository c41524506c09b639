"""The `priority` field on the replica's OpenAI endpoints: accepted (and reaching the engine),
bad values a 400 naming the field, per-priority metrics and load."""

import pytest

from tests.backend_engine.server.conftest import MODEL
from tests.backend_engine.server.test_server_errors import assert_error
from tests.backend_engine.server.test_server_metrics import scrape

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("priority", [0, -7, 3, 2**31 - 1, -(2**31)])
def test_priority_is_accepted_on_both_endpoints(http, priority):
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                    "max_tokens": 2, "priority": priority})
    assert chat.status_code == 200, chat.text
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                     "max_tokens": 2, "priority": priority})
    assert completion.status_code == 200, completion.text


@pytest.mark.parametrize("value", ["1", 1.5, True, "high", 2**31, -(2**31) - 1,
                                   [1], {"p": 1}])
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
])
def test_bad_priority_is_a_400_naming_the_field(http, path, body, value):
    r = http.post(path, json={**body, "priority": value})
    assert_error(r, 400, param="priority", code="invalid_value")


def test_null_priority_means_the_default(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                           "priority": None})
    assert r.status_code == 200


def test_ttft_is_exported_by_priority(http, client):
    before = scrape(http)
    for _ in range(2):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"priority": 3})
    after = scrape(http)
    name = 'kvgate_time_to_first_token_by_priority_seconds_count{priority="3"}'
    assert after.get(name, 0.0) - before.get(name, 0.0) == 2


def test_load_reports_work_by_priority(http):
    load = http.get("/kv/snapshot").json()["load"]
    assert isinstance(load["by_priority"], dict)  # empty while idle
    assert all(set(row) == {"running", "waiting", "pending_prefill_tokens"}
               for row in load["by_priority"].values())
