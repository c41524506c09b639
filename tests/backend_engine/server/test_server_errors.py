"""Bad input and failure modes: OpenAI's status, the error object, the SDK's exception class —
and the server keeps serving afterwards."""

import json

import openai
import pytest

from backend_engine.errors import InvalidRequestError
from tests.backend_engine.server.conftest import MAX_BODY_BYTES, MODEL

MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


def assert_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] is None or isinstance(err["code"], str)
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.fixture(autouse=True)
def still_serving(client):
    yield
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_malformed_json_is_400(http):
    r = http.post(CHAT, content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
    assert_error(r, 400, code="invalid_json")


def test_body_not_an_object_is_400(http):
    assert_error(http.post(CHAT, json=[1, 2]), 400)


@pytest.mark.parametrize("field,value,param", [
    ("max_tokens", "5", "max_tokens"),
    ("temperature", "hot", "temperature"),
    ("messages", [{"role": "user", "content": 5}], "messages[0].content"),
    ("messages", [{"role": "robot", "content": "x"}], "messages[0].role"),
    ("stop", ["a", "b", "c", "d", "e"], "stop"),
    ("unknown_field", 1, "unknown_field"),
    ("max_tokens", -5, "max_tokens"),
    ("n", 1000, "n"),
    ("top_logprobs", 3, "top_logprobs"),
    ("stream_options", {"include_usage": True}, "stream_options"),
    ("messages", [], "messages"),
    ("temperature", 3.0, "temperature"),
    ("logit_bias", {"x": 1}, "logit_bias"),
    ("response_format", {"type": "json_schema"}, "response_format.json_schema"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strang"}}},
     "response_format.json_schema.schema.type"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}},
     "response_format.json_schema.schema"),  # the replica's grammar compiler refuses it
    ("tools", [{"type": "function", "function": {"name": "bad name"}}], "tools[0].function.name"),
    ("tool_choice", "required", "tool_choice"),
    ("functions", [{"name": "f"}], "functions"),
])
def test_invalid_field_is_400_naming_param(http, field, value, param):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, field: value}
    assert_error(http.post(CHAT, json=body), 400, param=param)


def test_tools_with_tool_choice_none_are_accepted(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, tools=tools, tool_choice="none")
    assert resp.choices[0].message.tool_calls in (None, [])


def test_sdk_maps_400_to_bad_request_error(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=-1)
    assert info.value.status_code == 400 and info.value.body["param"] == "max_tokens"


def test_unknown_model_is_404_not_found_error(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_context_length_exceeded_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[7] * 600, max_tokens=4)
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100_000)
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "messages"


def test_oversized_body_is_413_and_server_keeps_serving(http):
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (50 * 1024 * 1024)}]})
    assert_error(http.post(CHAT, content=big, headers={"content-type": "application/json"}), 413)

    def chunks():  # no Content-Length: the limit is found while reading
        for _ in range(3):
            yield b" " * MAX_BODY_BYTES

    assert_error(http.post(CHAT, content=chunks(), headers={"content-type": "application/json"}), 413)


def test_sdk_maps_413(client):
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y" * (2 * MAX_BODY_BYTES)}])
    assert info.value.status_code == 413


def test_query_validation_is_400_not_422(http):
    assert_error(http.get("/kv/events", params={"since": "abc"}), 400, param="since")


def test_api_key_required_on_v1_when_configured(replica, http):
    replica.state.settings.api_key = "s3cret"
    try:
        base = replica.base_url + "/v1"
        with openai.OpenAI(base_url=base, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError) as info:
                bad.models.list()
            assert info.value.body["code"] == "invalid_api_key"
        assert_error(http.post(CHAT, json={"model": MODEL, "messages": MESSAGES}), 401)
        with openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0) as good:
            assert good.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1).choices
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
    finally:
        replica.state.settings.api_key = None


def test_full_waiting_queue_is_503_with_retry_after(replica, client, http):
    replica.engine.config.max_waiting = 0
    try:
        r = http.post(CHAT, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
        assert_error(r, 503, code="engine_overloaded")
        assert int(r.headers["retry-after"]) >= 1
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    finally:
        replica.engine.config.max_waiting = None


def test_internal_error_is_500_without_traceback(replica, http, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(replica.engine, "render_chat", broken)
    err = assert_error(http.post(CHAT, json={"model": MODEL, "messages": MESSAGES}), 500)
    assert "secret internal detail" not in err["message"] and err["type"] == "server_error"


def test_error_after_headers_is_one_error_event_then_done(replica, http, monkeypatch):
    real_generate = replica.engine.generate

    async def fails_mid_stream(*args, **kwargs):
        async for out in real_generate(*args, **kwargs):
            yield out
            raise InvalidRequestError("went wrong mid-stream", param="messages")

    monkeypatch.setattr(replica.engine, "generate", fails_mid_stream)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": True}
    with http.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][len("data: "):])["error"]
    assert err["message"] == "went wrong mid-stream" and err["param"] == "messages"
    assert all("error" not in json.loads(e[6:]) for e in events[:-2])
