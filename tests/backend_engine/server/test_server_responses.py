"""`/v1/responses` through the official openai SDK against a replica: text, structured output,
function tools (forced calls valid and identical streamed or not), a conversation carried in
`input` items, and clear refusals of what is not served."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from tests.backend_engine.server.conftest import MODEL

PARAMS = {"type": "object", "additionalProperties": False, "required": ["city"],
          "properties": {"city": {"type": "string", "maxLength": 10}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Forecast.", "parameters": PARAMS}]


class Answer(pydantic.BaseModel):
    ok: bool
    score: int = pydantic.Field(ge=0, le=10)


def test_text_input_gives_a_message_and_usage(client):
    r = client.responses.create(model=MODEL, input="Hello there", instructions="Be brief.",
                                max_output_tokens=6)
    assert r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output_text
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    assert r.instructions == "Be brief." and r.store is False


def test_parse_with_a_pydantic_text_format(client):
    r = client.responses.parse(model=MODEL, input=[{"role": "user", "content": "Rate it."}],
                               text_format=Answer, max_output_tokens=200)
    assert r.status == "completed" and isinstance(r.output_parsed, Answer)


def _stream(client, **kwargs) -> tuple[list[str], object]:
    with client.responses.stream(**kwargs) as stream:
        types = [event.type for event in stream]
        return types, stream.get_final_response()


def test_streamed_events_arrive_in_openai_order(client):
    types, final = _stream(client, model=MODEL, input="Rate it.", text_format=Answer,
                           max_output_tokens=200, temperature=0)
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert "response.output_text.delta" in types
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    plain = client.responses.parse(model=MODEL, input="Rate it.", text_format=Answer,
                                   max_output_tokens=200, temperature=0)
    assert final.output_parsed == plain.output_parsed


def _calls(response) -> list[tuple[str, dict]]:
    return [(o.name, json.loads(o.arguments)) for o in response.output if o.type == "function_call"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_function_calls_are_valid_and_stream_identically(client, tool_choice):
    kwargs = dict(model=MODEL, input="Weather in Oslo?", tools=TOOLS, tool_choice=tool_choice,
                  max_output_tokens=240, temperature=0, parallel_tool_calls=False)
    r = client.responses.create(**kwargs)
    calls = _calls(r)
    assert r.status == "completed" and len(calls) == 1 and calls[0][0] == "get_weather"
    jsonschema.validate(calls[0][1], PARAMS)
    types, final = _stream(client, **kwargs)
    assert _calls(final) == calls
    assert types[2:6] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done"]


def test_a_conversation_with_a_function_call_and_its_output(client):
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"type": "function_call", "call_id": "call_9", "name": "get_weather",
                "arguments": '{"city": "Oslo"}'},
               {"type": "function_call_output", "call_id": "call_9", "output": "snow, -3C"}]
    r = client.responses.create(model=MODEL, input=history, tools=TOOLS, tool_choice="none",
                                max_output_tokens=5)
    assert r.output[0].type == "message" and r.usage.input_tokens > 20


@pytest.mark.parametrize("kwargs,param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}},
     "text.format.schema"),
])
def test_what_is_not_served_is_a_clear_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", **kwargs)
    assert info.value.body["param"] == param
