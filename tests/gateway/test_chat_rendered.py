"""Messages and Responses streams that may migrate: their legs ask for chat chunks, and the
spliced chunks become the API's own events — an error event (the migration gave up) too."""

from __future__ import annotations

import json

from gateway.chat_rendered import CHAT_PATH, resumable_rendered
from protocol.anthropic import MessagesRequest
from protocol.responses import ResponsesRequest
from protocol.sse import DONE


def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
    payload = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": usage}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def events_of(chunks: list[bytes], req, path: str) -> list[dict]:  # noqa: ANN001
    async def source():
        for c in chunks:
            yield c

    render = resumable_rendered(req, path, {}).render
    out = b"".join([e async for e in render(source())])
    return [json.loads(line[6:]) for line in out.decode().splitlines() if line.startswith("data: {")]


MESSAGES = MessagesRequest.model_validate({"model": "m", "max_tokens": 9, "stream": True,
                                           "messages": [{"role": "user", "content": "hi"}]})
RESPONSES = ResponsesRequest.model_validate({"model": "m", "input": "hi", "stream": True})
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_legs_ask_a_kvgate_replica_for_chat_chunks_with_token_ids_and_usage():
    for req, path in ((MESSAGES, "/v1/messages"), (RESPONSES, "/v1/responses")):
        migrates = resumable_rendered(req, path, {"priority": 3})
        body = json.loads(migrates.first_body())
        assert migrates.path == CHAT_PATH and body["return_token_ids"] and body["priority"] == 3
        assert body["stream"] and body["stream_options"]["include_usage"]
        assert body["messages"][-1] == {"role": "user", "content": "hi"}


def test_what_a_chat_request_cannot_say_does_not_migrate():
    capped = RESPONSES.model_copy(update={"max_tool_calls": 1})
    assert resumable_rendered(capped, "/v1/responses", {}) is None
    unstreamed = MESSAGES.model_copy(update={"stream": False})
    assert resumable_rendered(unstreamed, "/v1/messages", {}) is None


async def test_spliced_chunks_become_the_responses_events():
    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}),
              chunk({"content": "lo"}), chunk({}, "length"),
              b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1,
                                      "model": "m", "choices": [], "usage": USAGE}).encode()
              + b"\n\n" + DONE]
    events = await events_of(chunks, RESPONSES, "/v1/responses")
    assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello"
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["usage"]["output_tokens"] == 2
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


async def test_a_migration_that_gave_up_ends_with_the_apis_error_event():
    error = {"error": {"message": "the migration limit (1) is reached", "type": "server_error",
                       "param": None, "code": "upstream_error"}}
    broken = b"data: " + json.dumps(error).encode() + b"\n\n" + DONE
    messages = await events_of([chunk({"content": "Hi"}, usage=USAGE), broken], MESSAGES,
                               "/v1/messages")
    assert messages[-1]["type"] == "error" and "migration limit" in messages[-1]["error"]["message"]
    assert not any(e["type"] == "message_stop" for e in messages)
    responses = await events_of([chunk({"content": "Hi"}), broken], RESPONSES, "/v1/responses")
    assert responses[-1] == {"error": {**error["error"], "type": "server_error"}}
