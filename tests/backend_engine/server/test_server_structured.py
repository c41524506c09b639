"""Structured outputs and tool calls through the official openai SDK against a replica (a tiny
random model: constrained output is valid whatever the weights)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.backend_engine.server.conftest import MODEL
from tests.backend_engine.structured.json_schemas import json_schemas

MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                  "properties": {"city": {"type": "string", "maxLength": 10},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast.",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=130)
    nickname: str | None = pydantic.Field(default=None, max_length=6)


def test_parse_with_a_pydantic_model(client):
    out = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Person,
                                        max_tokens=300, seed=3)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)


def test_streamed_parse_gives_the_same_object(client):
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, response_format=Person,
                                        max_tokens=300, seed=4, temperature=0) as stream:
        final = stream.get_final_completion()
    plain = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Person,
                                          max_tokens=300, seed=4, temperature=0)
    assert final.choices[0].message.parsed == plain.choices[0].message.parsed


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=json_schemas(max_leaves=6))
def test_random_json_schemas_always_yield_valid_output(client, schema):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=450, temperature=1.0, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "random", "schema": schema,
                                                                "strict": True}})
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("constraint,check", [
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"regex": "[0-9]{4}-[0-9]{2}"}, lambda t: len(t) == 7 and t[4] == "-"),
    ({"grammar": 'root ::= "yes" | "no" | "maybe"'}, lambda t: t in ("yes", "no", "maybe")),
])
def test_vllm_structured_outputs_extra_on_both_endpoints(client, constraint, check):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                          extra_body={"structured_outputs": constraint})
    assert check(chat.choices[0].message.content)
    text = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20,
                                     extra_body={"structured_outputs": constraint})
    assert check(text.choices[0].text)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed(client, **kwargs) -> tuple[str, list[tuple[str, dict]], str]:
    content, calls, finish, ids = "", {}, None, set()
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.id is not None:  # the first piece: index, id, type and name
                    assert tc.index == len(calls) and tc.type == "function" and tc.function.name
                    ids.add(tc.id)
                    calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
                else:
                    calls[tc.index][1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert len(ids) == len(calls)
    return content, [(n, json.loads(a)) for n, a in calls.values()], finish


@pytest.mark.parametrize("tool_choice,parallel", [
    ("required", True), ("required", False),
    ({"type": "function", "function": {"name": "get_time"}}, True)])
def test_forced_tool_calls_are_schema_valid_streamed_or_not(client, tool_choice, parallel):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                  parallel_tool_calls=parallel, max_tokens=240, temperature=1.0, seed=21)
    out = client.chat.completions.create(**kwargs)
    message = out.choices[0].message
    calls = _calls(message)
    assert out.choices[0].finish_reason == "tool_calls" and message.content is None and calls
    assert parallel or len(calls) == 1
    for name, arguments in calls:
        assert tool_choice == "required" or name == "get_time"
        jsonschema.validate(arguments, SCHEMAS[name])
    content, streamed, finish = _streamed(client, **kwargs)
    assert (content, streamed, finish) == ("", calls, "tool_calls")  # same seed, same answer


def test_auto_with_a_json_response_format_is_either_valid_content_or_valid_calls(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}}}
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, response_format=fmt, max_tokens=240,
                  temperature=1.0, seed=5)
    kinds = set()
    for seed in range(40):
        if kinds == {"calls", "content"}:
            break
        kwargs["seed"] = seed
        out = client.chat.completions.create(**kwargs)
        choice = out.choices[0]
        if choice.message.tool_calls:
            kinds.add("calls")
            assert choice.finish_reason == "tool_calls" and not choice.message.content
            for name, arguments in _calls(choice.message):
                jsonschema.validate(arguments, SCHEMAS[name])
            expected = ("", _calls(choice.message), "tool_calls")
        else:
            kinds.add("content")
            assert choice.finish_reason == "stop"
            assert json.loads(choice.message.content) in ({"ok": True}, {"ok": False})
            expected = (choice.message.content, [], "stop")
        assert _streamed(client, **kwargs) == expected
    assert kinds == {"calls", "content"}  # the parser read both kinds of answer


def test_tool_history_renders_and_tools_reach_the_prompt(client, http):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "snow"}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=5)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    bare = http.post("/tokenize", json={"model": MODEL, "messages": history}).json()["count"]
    with_tools = http.post("/tokenize", json={"model": MODEL, "messages": history,
                                              "tools": TOOLS}).json()["count"]
    assert with_tools > bare + 40  # the template has no tools slot: they are in the system turn
    assert out.usage.prompt_tokens == with_tools


def test_bad_constraints_are_400s_and_leave_nothing_behind(client, replica):
    for extra, param in (({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
                         ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=extra)
        assert info.value.body["param"] == param
    engine = replica.engine.engine
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_model_cards_advertise_the_features_and_metrics_show_grammar_times(client, http):
    card = http.get("/v1/models").json()["data"][0]
    assert {"json_schema", "json_object", "structured_outputs", "tools", "responses"} <= set(card["features"])
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                   extra_body={"structured_outputs": {"choice": ["metric"]}})
    metrics = http.get("/metrics").text
    counts = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith(("kvgate_grammar_compile_seconds_count",
                                  "kvgate_grammar_bitmask_seconds_count"))}
    assert counts["kvgate_grammar_compile_seconds_count"] > 0
    assert counts["kvgate_grammar_bitmask_seconds_count"] > 0


_KEYWORDS = ["type", "properties", "required", "items", "anyOf", "oneOf", "allOf", "enum", "const",
             "pattern", "minLength", "maxLength", "minimum", "maximum", "additionalProperties",
             "$ref", "$defs", "format", "minItems", "maxItems", "prefixItems", "not", "x"]
_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-5, 50),
                    st.sampled_from(["string", "integer", "object", "array", "null", "#/$defs/a",
                                     "email", "[a-z]+", "(", "a{3}"]))
_JUNK = st.recursive(_LEAVES, lambda c: st.one_of(
    st.lists(c, max_size=3), st.dictionaries(st.sampled_from(_KEYWORDS), c, max_size=4)),
    max_leaves=10)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_JUNK, where=st.sampled_from(["response_format", "structured_outputs", "tools", "responses"]))
def test_any_schema_is_served_or_refused_never_a_server_error(http, schema, where):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}
    path = "/v1/chat/completions"
    if where == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    elif where == "structured_outputs":
        body["structured_outputs"] = {"json": schema}
    elif where == "tools":
        body.update(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
                    tool_choice="required")
    else:
        path, body = "/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 8, "text": {
            "format": {"type": "json_schema", "name": "x", "schema": schema}}}
    response = http.post(path, json=body)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
