"""`/v1/messages` through the official anthropic SDK against a replica: text, the streamed event
sequence, a forced tool call round trip, stop sequences, count_tokens, prefix-cache reads in
usage, and Anthropic-shaped refusals of bad input that leave nothing behind."""

from __future__ import annotations

import anthropic
import pytest

from tests.backend_engine.server.conftest import MODEL
from tests.backend_engine.server.harness import wait_until

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city"],
          "properties": {"city": {"type": "string", "maxLength": 10}}}
TOOLS = [{"name": "get_weather", "description": "Forecast.", "input_schema": SCHEMA}]
HELLO = [{"role": "user", "content": "Say hello."}]
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture()
def claude(replica):
    with anthropic.Anthropic(base_url=replica.base_url, api_key="unused", max_retries=0,
                             timeout=60) as c:
        yield c


def test_plain_message_has_text_usage_and_stop_reason(claude):
    m = claude.messages.create(model=MODEL, max_tokens=5, messages=HELLO,
                               system=[{"type": "text", "text": "Be brief."}],
                               metadata={"user_id": "u1"}, **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.id.startswith("msg_") and m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 5 and m.usage.input_tokens > 0


def event_names(http, body: dict) -> list[str]:
    """The `event:` names of a raw Messages stream, in order."""
    with http.stream("POST", "/v1/messages", json={"stream": True, **body}) as response:
        assert response.status_code == 200
        return [line[7:] for line in response.iter_lines() if line.startswith("event: ")]


def test_stream_sends_anthropic_events_in_order(claude, http):
    names = event_names(http, {"model": MODEL, "max_tokens": 6, "messages": HELLO, "temperature": 0})
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    with claude.messages.stream(model=MODEL, max_tokens=6, messages=HELLO, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    plain = claude.messages.create(model=MODEL, max_tokens=6, messages=HELLO, **GREEDY)
    assert final.content[0].text == text == plain.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        plain.usage.input_tokens + plain.usage.cache_read_input_tokens


def test_stop_sequence_is_reported(claude):
    text = claude.messages.create(model=MODEL, max_tokens=12, messages=HELLO, **GREEDY).content[0].text
    stop = text[4:7]
    m = claude.messages.create(model=MODEL, max_tokens=12, messages=HELLO, stop_sequences=[stop],
                               **GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert stop not in m.content[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_round_trip(claude, stream):
    kwargs = dict(model=MODEL, max_tokens=120, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Oslo?"}], **GREEDY)
    # one call each: with parallel calls allowed, a random-weight model may go on calling
    for choice in ({"type": "tool", "name": "get_weather"},
                   {"type": "any", "disable_parallel_tool_use": True}):
        if stream:
            with claude.messages.stream(tool_choice=choice, **kwargs) as s:
                types = {event.type for event in s}
                m = s.get_final_message()
            assert "input_json" in types  # the SDK's event for an input_json_delta
        else:
            m = claude.messages.create(tool_choice=choice, **kwargs)
        assert m.stop_reason == "tool_use"
        call = m.content[-1]
        assert call.type == "tool_use" and call.name == "get_weather"
        assert isinstance(call.input["city"], str) and len(call.input["city"]) <= 10
    answer = claude.messages.create(model=MODEL, max_tokens=4, tools=TOOLS, **GREEDY, messages=[
        *kwargs["messages"], {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}])
    assert answer.content[0].type == "text" and answer.stop_reason == "max_tokens"


def test_count_tokens_matches_the_prompt_of_a_message(claude):
    system = "You answer in one word."
    counted = claude.messages.count_tokens(model=MODEL, system=system, messages=HELLO, tools=TOOLS)
    m = claude.messages.create(model=MODEL, max_tokens=1, system=system, messages=HELLO,
                               tools=TOOLS)
    total = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert counted.input_tokens == total > 0


def test_repeated_long_prefix_is_read_from_the_cache(claude):
    system = " ".join(f"Rule {i}: answer precisely and briefly." for i in range(30))
    first = claude.messages.create(model=MODEL, max_tokens=1, system=system, messages=HELLO)
    again = claude.messages.create(model=MODEL, max_tokens=1, system=system, messages=[
        {"role": "user", "content": "Say goodbye."}])
    assert again.usage.cache_read_input_tokens >= 16 * 8
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens > \
        again.usage.cache_read_input_tokens
    with claude.messages.stream(model=MODEL, max_tokens=1, system=system, messages=HELLO) as s:
        assert s.get_final_message().usage.cache_read_input_tokens > first.usage.cache_read_input_tokens


BAD = [
    ({"messages": HELLO}, 400, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages[0].content[0].text"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "image"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]}, 400, "tool_use"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a",
                                                                   "name": "f", "input": {}}]}]},
     400, "user message"),
    ({"max_tokens": 4, "messages": HELLO, "tool_choice": {"type": "any"}}, 400, "tool_choice"),
    ({"max_tokens": 4, "messages": HELLO, "temperature": 1.5}, 400, "temperature"),
    ({"max_tokens": 4, "messages": HELLO, "model": "missing-model"}, 404, "missing-model"),
]


@pytest.mark.parametrize(("body", "status", "mentions"), BAD)
def test_bad_input_gets_an_anthropic_error_and_leaks_nothing(replica, http, body, status, mentions):
    engine = replica.engine
    assert wait_until(lambda: engine.load()["running"] == 0 and engine.load()["waiting"] == 0)
    free = engine.num_free_blocks()
    response = http.post("/v1/messages", json={"model": MODEL, **body})
    assert response.status_code == status
    error = response.json()
    assert error["type"] == "error" and mentions in error["error"]["message"]
    assert error["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert not replica.state.in_flight and engine.num_free_blocks() == free


def test_sdk_raises_typed_errors(claude):
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="missing-model", max_tokens=4, messages=HELLO)
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"}]}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"


def test_oversized_body_is_an_anthropic_413(http):
    response = http.post("/v1/messages", content=b"x" * (2 * 1024 * 1024),
                         headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"


def test_chat_errors_keep_openai_shape(http):
    response = http.post("/v1/chat/completions", json={"model": "missing-model", "messages": HELLO})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
