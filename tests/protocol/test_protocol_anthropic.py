"""The Messages API's translation without a server: requests into chat requests, chat answers
and chunks into a Message and its events (reasoning into thinking blocks), and errors into
Anthropic's shapes and status codes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from protocol.anthropic import MessagesRequest
from protocol.anthropic_chat import message_of, to_chat
from protocol.anthropic_errors import error_body, stream_error
from protocol.anthropic_stream import MessageEvents
from protocol.chat import AssistantMessage, ChatChoice, ChatCompletion
from protocol.common import Usage
from protocol.errors import APIError, bad_request, service_unavailable

TOOL = {"name": "lookup", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}


def request(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **kw})


def test_conversation_becomes_chat_messages_with_tool_calls_and_results():
    chat = to_chat(request(
        system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B",
                                                "cache_control": {"type": "ephemeral"}}],
        tools=[TOOL], tool_choice={"type": "tool", "name": "lookup", "disable_parallel_tool_use": True},
        stop_sequences=["END"], metadata={"user_id": "u"}, top_k=5, messages=[
            {"role": "user", "content": "find x"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "found"}]},
                {"type": "text", "text": "thanks"}]}]))
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "A\n\nB"
    call = chat.messages[2].tool_calls[0]
    assert call["id"] == "toolu_1" and json.loads(call["function"]["arguments"]) == {"q": "x"}
    assert chat.messages[3].tool_call_id == "toolu_1" and chat.messages[3].content == "found"
    assert chat.tool_choice_name == "lookup" and chat.parallel_tool_calls is False
    assert chat.stop == ["END"] and chat.user == "u" and chat.top_k == 5 and chat.max_tokens == 8


def test_final_assistant_text_is_continued_and_any_means_required():
    chat = to_chat(request(tools=[TOOL], tool_choice={"type": "any"}, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}]))
    assert chat.continue_final_message and chat.add_generation_prompt is False
    assert chat.tool_choice_name == "required"


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools[0].input_schema.type"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice")])
def test_chat_checks_name_the_messages_fields(extra, param):
    with pytest.raises(APIError) as caught:
        to_chat(request(messages=[{"role": "user", "content": "x"}], **extra))
    assert caught.value.status_code == 400 and caught.value.param == param
    assert "function.parameters" not in caught.value.message and "'stop'" not in caught.value.message


def completion(finish: str, stop_reason=None, reasoning: str | None = None) -> ChatCompletion:
    message = AssistantMessage(content="hi")
    if reasoning is not None:  # the reasoning parser's field, set the way its models carry it
        object.__setattr__(message, "reasoning_content", reasoning)
    return ChatCompletion(id="msg_1", created=0, model="m", usage=Usage.of(40, 3, 32), choices=[
        ChatChoice(index=0, message=message, finish_reason=finish, stop_reason=stop_reason)])


@pytest.mark.parametrize(("finish", "matched", "reason", "sequence"), [
    ("stop", None, "end_turn", None), ("stop", 2, "end_turn", None),
    ("stop", "END", "stop_sequence", "END"), ("length", None, "max_tokens", None),
    ("tool_calls", None, "tool_use", None)])
def test_stop_reasons_and_usage(finish, matched, reason, sequence):
    m = message_of(completion(finish, matched), ["END"])
    assert (m.stop_reason, m.stop_sequence) == (reason, sequence)
    assert (m.usage.input_tokens, m.usage.cache_read_input_tokens, m.usage.output_tokens) == (8, 32, 3)


def test_reasoning_becomes_a_thinking_block():
    m = message_of(completion("stop", reasoning="let me think"), None)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "let me think"


def chunk(usage=None, finish=None, **delta):
    fields = {"role": None, "content": None, "tool_calls": None, **delta}
    choice = SimpleNamespace(delta=SimpleNamespace(**fields), finish_reason=finish,
                             stop_reason=None)
    return SimpleNamespace(usage=usage, choices=[choice])


def events(frames: list[bytes]) -> list[dict]:
    out = []
    for frame in frames:
        name, data = frame.decode().strip().split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        out.append(payload)
    return out


def test_chunks_become_blocks_with_thinking_text_and_tool_input():
    call = SimpleNamespace(id="call_1", function=SimpleNamespace(name="lookup", arguments='{"q":'))
    rest = SimpleNamespace(id=None, function=SimpleNamespace(name=None, arguments='"x"}'))
    stream = MessageEvents("msg_1", "m", None)
    frames = [*stream.feed(chunk(role="assistant", content=""))]
    assert frames == []  # message_start waits for the usage that says what was cached
    usage = Usage.of(40, 1, 32)
    for c in (chunk(usage, reasoning_content="hmm"), chunk(usage, content="ok"),
              chunk(usage, tool_calls=[call]), chunk(usage, tool_calls=[rest]),
              chunk(Usage.of(40, 5, 32), finish="tool_calls")):
        frames += stream.feed(c)
    got = events(frames + list(stream.close()))
    assert [e["type"] for e in got] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert got[0]["message"]["usage"]["cache_read_input_tokens"] == 32
    assert [got[i]["content_block"]["type"] for i in (2, 5, 8)] == ["thinking", "text", "tool_use"]
    assert got[3]["delta"] == {"type": "thinking_delta", "thinking": "hmm"}
    assert "".join(got[i]["delta"]["partial_json"] for i in (9, 10)) == '{"q":"x"}'
    assert got[-2]["delta"]["stop_reason"] == "tool_use" and got[-2]["usage"]["output_tokens"] == 5


@pytest.mark.parametrize(("error", "status", "kind"), [
    (bad_request("bad"), 400, "invalid_request_error"),
    (service_unavailable("busy"), 529, "overloaded_error"),
    (APIError(500, "oops", "server_error"), 500, "api_error"),
    (APIError(429, "slow down", "requests"), 429, "rate_limit_error")])
def test_errors_take_anthropic_shape_only_on_its_paths(error, status, kind):
    assert error_body(error, "/v1/messages") == (
        status, {"type": "error", "error": {"type": kind, "message": error.message}})
    assert error_body(error, "/v1/chat/completions") == (error.status_code, error.to_dict())
    assert stream_error(error, "/v1/messages/count_tokens").startswith(b"event: error\n")
    assert stream_error(error, "/v1/chat/completions").endswith(b"data: [DONE]\n\n")
