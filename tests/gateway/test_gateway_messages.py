"""The Messages API through the gateway with the official anthropic SDK (its `x-api-key`
header): answers equal a direct replica's, tokenised and hashed like the equivalent chat
request, count_tokens answered, and Anthropic-shaped errors for bad input, keys and limits."""

from __future__ import annotations

import anthropic
import httpx
import pytest
import yaml

from tests.gateway import procs
from tests.gateway.test_gateway_keys import inside_one_window

pytestmark = pytest.mark.timeout(180)

KEY, LIMITED = "sk-claude-1", "sk-claude-rpm-2"
SCHEMA = {"type": "object", "required": ["city"],
          "properties": {"city": {"type": "string", "maxLength": 10}}}
TOOLS = [{"name": "get_weather", "description": "Forecast.", "input_schema": SCHEMA}]
HELLO = [{"role": "user", "content": "Say hello."}]
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    config = tmp_path_factory.mktemp("gw") / "gateway.yaml"
    config.write_text(yaml.safe_dump({"api_keys": [
        {"key": KEY, "name": "claude"}, {"key": LIMITED, "name": "limited", "rpm": 1}]}))
    replica = procs.replica().start()
    gateway = procs.gateway([replica.url], config=str(config)).start()
    try:
        yield replica, gateway
    finally:
        gateway.stop()
        replica.stop()


def claude(base: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=60)


def last_decision(gw) -> dict:
    return procs.admin(gw, "/decisions?limit=1").json()["data"][0]


def test_message_and_stream_equal_a_direct_replica(fleet):
    replica, gw = fleet
    kwargs = dict(model=procs.MODEL, max_tokens=6, messages=HELLO, system="Be brief.", **GREEDY)
    direct = claude(replica.url).messages.create(**kwargs)
    via = claude(gw.url).messages.create(**kwargs)
    assert via.content[0].text == direct.content[0].text and via.stop_reason == "max_tokens"
    assert last_decision(gw)["endpoint"] == "messages"
    with claude(gw.url).messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == direct.content[0].text and final.usage.output_tokens == 6


def test_routed_with_the_tokens_and_blocks_of_the_equivalent_chat(fleet):
    _, gw = fleet
    system = procs.long_system_prompt("messages-chat")
    m = claude(gw.url).messages.create(model=procs.MODEL, max_tokens=1, system=system,
                                       messages=HELLO)
    as_messages = last_decision(gw)
    chat = httpx.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60, json={"model": procs.MODEL, "max_tokens": 1, "messages": [
                          {"role": "system", "content": system}, *HELLO]})
    assert chat.status_code == 200
    as_chat = last_decision(gw)
    assert as_chat["prompt_tokens"] == as_messages["prompt_tokens"] == \
        m.usage.input_tokens + m.usage.cache_read_input_tokens
    full_blocks = (as_chat["prompt_tokens"] - 1) // 16 * 16
    assert as_chat["predicted_cached_tokens"] >= full_blocks > 0
    assert chat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= full_blocks
    again = claude(gw.url).messages.create(model=procs.MODEL, max_tokens=1, system=system,
                                           messages=HELLO)
    assert again.usage.cache_read_input_tokens >= full_blocks
    assert procs.wait_until(lambda: (last_decision(gw)["engine_cached_tokens"] or 0) >= full_blocks)


def test_forced_tool_call_round_trip_through_the_gateway(fleet):
    _, gw = fleet
    client = claude(gw.url)
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    with client.messages.stream(model=procs.MODEL, max_tokens=120, tools=TOOLS, messages=ask,
                                tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY) as s:
        m = s.get_final_message()
    call = m.content[-1]
    assert m.stop_reason == "tool_use" and call.type == "tool_use" and "city" in call.input
    answer = client.messages.create(model=procs.MODEL, max_tokens=3, tools=TOOLS, messages=[
        *ask, {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "Sunny"}]}])
    assert answer.content[0].type == "text"


def test_count_tokens_is_answered_like_the_replica(fleet):
    replica, gw = fleet
    kwargs = dict(model=procs.MODEL, system="Count me.", messages=HELLO, tools=TOOLS)
    via = claude(gw.url).messages.count_tokens(**kwargs)
    assert via.input_tokens == claude(replica.url).messages.count_tokens(**kwargs).input_tokens > 0


def error_of(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    return body["error"]["message"]


@pytest.mark.parametrize(("body", "status", "kind"), [
    ({"messages": HELLO}, 400, "invalid_request_error"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "nope"}]}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"}]}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 4, "messages": HELLO, "model": "missing-model"}, 404, "not_found_error"),
])
def test_bad_input_gets_anthropic_errors_at_the_gateway(fleet, body, status, kind):
    _, gw = fleet
    response = httpx.post(gw.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=30,
                          json={"model": procs.MODEL, **body})
    error_of(response, status, kind)
    # refused before any replica was booked: nothing stays in flight
    assert procs.wait_until(lambda: [r["in_flight"] for r in procs.admin(gw, "/replicas").json()[
        "data"]] == [0])


def test_keys_and_limits_answer_in_anthropic_shape(fleet):
    _, gw = fleet
    body = {"model": procs.MODEL, "max_tokens": 1, "messages": HELLO}
    error_of(httpx.post(gw.url + "/v1/messages", json=body, timeout=30), 401,
             "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        claude(gw.url, "sk-wrong").messages.create(**body)
    limited = claude(gw.url, LIMITED)
    inside_one_window()
    limited.messages.create(**body)
    with pytest.raises(anthropic.RateLimitError) as caught:
        limited.messages.create(**body)
    assert caught.value.body["error"]["type"] == "rate_limit_error"
    chat = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)
    assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key"
