"""`/admin/pins` on a real replica: pin by text, token ids or messages; pinned blocks visible in
the listing, /metrics and the load report; bad input refused with OpenAI errors, changing nothing."""

import pytest

from tests.backend_engine.server.conftest import BLOCK_SIZE, MODEL, NUM_KV_BLOCKS

PREFIX = list(range(2000, 2048))  # 3 full blocks
CAPACITY = NUM_KV_BLOCKS // 4  # the default max_pinned_fraction


@pytest.fixture()
def pins(http):
    yield http
    for pin in http.get("/admin/pins").json()["data"]:
        http.delete(f"/admin/pins/{pin['id']}")


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_pin_by_token_ids_is_listed_measured_and_hit(pins):
    created = pins.post("/admin/pins", json={"model": MODEL, "id": "sys", "token_ids": PREFIX})
    assert created.status_code == 200, created.text
    assert created.json() | {"created": 0} == {
        "id": "sys", "state": "pinned", "num_tokens": 48, "num_blocks": 3, "cache_salt": None,
        "excerpt": "[48 token ids]", "created": 0, "model": MODEL}
    listing = pins.get("/admin/pins").json()
    assert [p["id"] for p in listing["data"]] == ["sys"]
    assert (listing["pinned_blocks"], listing["max_pinned_blocks"]) == (3, CAPACITY)
    assert listing["block_size"] == BLOCK_SIZE
    metrics = pins.get("/metrics").text
    assert "kvgate_kv_cache_pinned_blocks 3.0" in metrics
    assert f"kvgate_kv_cache_pinned_capacity_blocks {float(CAPACITY)}" in metrics
    assert "kvgate_pinned_prefixes 1.0" in metrics
    assert pins.get("/kv/snapshot").json()["load"]["pinned_blocks"] == 3
    done = pins.post("/v1/completions", json={"model": MODEL, "prompt": PREFIX + [5, 6], "max_tokens": 1})
    assert done.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert pins.delete("/admin/pins/sys").json() == {"id": "sys", "deleted": True}
    assert pins.get("/admin/pins").json()["pinned_blocks"] == 0


def test_pin_by_text_and_by_messages_tokenise_as_requests_do(pins):
    text = "You are the billing assistant of ACME. " * 8
    by_text = pins.post("/admin/pins", json={"model": MODEL, "prompt": text})
    assert by_text.status_code == 200, by_text.text
    assert by_text.json()["excerpt"].startswith("You are the billing assistant of ACME.")
    system = [{"role": "system", "content": text}]
    by_chat = pins.post("/admin/pins", json={"model": MODEL, "messages": system})
    assert by_chat.status_code == 200, by_chat.text
    chat = pins.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 1, "messages": system + [{"role": "user", "content": "hi"}]})
    cached = chat.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= by_chat.json()["num_blocks"] * BLOCK_SIZE > 0


def test_pinning_the_same_id_again_is_idempotent(pins):
    body = {"model": MODEL, "id": "again", "token_ids": PREFIX}
    first = pins.post("/admin/pins", json=body).json()
    assert pins.post("/admin/pins", json=body).json() == first
    assert pins.get("/admin/pins").json()["pinned_blocks"] == 3


@pytest.mark.parametrize("body, status, param, code", [
    ({"model": "nope", "token_ids": PREFIX}, 404, "model", "model_not_found"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "messages": []}, 400, "messages", "invalid_value"),
    ({"model": MODEL}, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "token_ids": PREFIX}, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "token_ids": list(range(10))}, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "token_ids": [1] * 600}, 400, "token_ids", "context_length_exceeded"),
    ({"model": MODEL, "token_ids": [10 ** 6] * 32}, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "token_ids": list(range(16 * (CAPACITY + 1)))}, 400, "prompt",
     "pinned_capacity_exceeded"),
    ({"model": MODEL, "id": "bad id!", "token_ids": PREFIX}, 400, "id", "invalid_value"),
    ({"model": MODEL, "token_ids": PREFIX, "extra": 1}, 400, "extra", "unknown_parameter"),
])
def test_bad_pins_are_refused_and_pin_nothing(pins, body, status, param, code):
    error = _error(pins.post("/admin/pins", json=body), status)
    assert (error["param"], error["code"]) == (param, code)
    listing = pins.get("/admin/pins").json()
    assert listing["data"] == [] and listing["pinned_blocks"] == 0


def test_deleting_an_unknown_pin_is_a_404(pins):
    assert _error(pins.delete("/admin/pins/nope"), 404)["code"] == "not_found"


def test_pins_need_the_api_key_when_one_is_configured(replica, pins):
    replica.state.settings.api_key = "s3cret"
    try:
        assert _error(pins.get("/admin/pins"), 401)["code"] == "invalid_api_key"
        assert _error(pins.post("/admin/pins", json={"model": MODEL, "token_ids": PREFIX}), 401)
        ok = pins.get("/admin/pins", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
    finally:
        replica.state.settings.api_key = None
