"""Structured outputs, tool calls and /v1/responses through the gateway: the official openai SDK
gets what a replica gives; a request goes only to replicas that serve its features (kvgate
replicas advertise them, a foreign one is configured with --replica-engine); 400 only when no
replica of the model can; tools count in the routing tokens, so agent prompts hit the cache."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings

from benchmarks.gateway_overhead import FIXTURE_MODEL
from tests.backend_engine.structured.json_schemas import json_schemas
from tests.gateway import procs

pytestmark = pytest.mark.timeout(300)

PARAMS = {"type": "object", "additionalProperties": False, "required": ["city"],
          "properties": {"city": {"type": "string", "maxLength": 10}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
# A long tool list, as agent frameworks send: the same on every turn of every conversation.
AGENT_TOOLS = TOOLS + [{"type": "function", "function": {
    "name": f"tool_{i}", "description": f"Does step {i} of the agent's plan, carefully and well.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}} for i in range(12)]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def cluster():
    replica = procs.replica()
    plain, vllm = procs.fixture_upstream(), procs.fixture_upstream()
    procs.start_all([replica, plain, vllm])
    folder = procs.tokenizer_folder()
    gateway = procs.gateway([replica.url, plain.url, vllm.url], "--tokenizer", f"{FIXTURE_MODEL}={folder}",
                            "--replica-engine", f"{vllm.url}=vllm").start()
    only_plain = procs.gateway([plain.url], "--tokenizer", f"{FIXTURE_MODEL}={folder}").start()
    try:
        yield replica, plain, vllm, gateway, only_plain
    finally:
        for p in (gateway, only_plain, replica, plain, vllm):
            p.stop()


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def name_of(proc: procs.Proc) -> str:
    return proc.url.split("://", 1)[1]


def test_sdk_structured_outputs_and_tools_through_the_gateway(cluster):
    replica, _, _, gateway, _ = cluster
    client = sdk(gateway.url)
    parsed = client.chat.completions.parse(model=procs.MODEL, response_format=Person, max_tokens=200,
                                           messages=[{"role": "user", "content": "A person."}], seed=1)
    assert isinstance(parsed.choices[0].message.parsed, Person)
    kwargs = dict(model=procs.MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                  tool_choice="required", parallel_tool_calls=False, max_tokens=200, seed=2)
    via = client.chat.completions.create(**kwargs)
    direct = sdk(replica.url).chat.completions.create(**kwargs)
    call = via.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)
    assert via.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in direct.choices[0].message.tool_calls] == \
        [(call.function.name, call.function.arguments)]
    streamed = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = streamed.setdefault(tc.index, [tc.function.name, ""])
            entry[1] += tc.function.arguments or ""
    assert list(streamed.values()) == [[call.function.name, call.function.arguments]]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=json_schemas(max_leaves=5))
def test_random_json_schemas_through_the_gateway_always_validate(cluster, schema):
    gateway = cluster[3]
    out = sdk(gateway.url).chat.completions.create(
        model=procs.MODEL, messages=[{"role": "user", "content": "JSON please."}], max_tokens=400,
        temperature=1.0, response_format={"type": "json_schema", "json_schema": {
            "name": "random", "schema": schema, "strict": True}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_sdk_responses_through_the_gateway(cluster):
    _, _, _, gateway, _ = cluster
    client = sdk(gateway.url)
    r = client.responses.parse(model=procs.MODEL, input="A person, please.", text_format=Person,
                               max_output_tokens=200)
    assert r.status == "completed" and isinstance(r.output_parsed, Person)
    tools = [{"type": "function", "name": "get_weather", "parameters": PARAMS}]
    with client.responses.stream(model=procs.MODEL, input="Weather?", tools=tools,
                                 tool_choice="required", parallel_tool_calls=False,
                                 max_output_tokens=200) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_response()
    assert events[0] == "response.created" and events[-1] == "response.completed"
    jsonschema.validate(json.loads(final.output[0].arguments), PARAMS)
    decision = procs.admin(gateway, "/decisions?limit=2").json()["data"]
    assert decision[0]["endpoint"] == "responses"
    assert decision[0]["prompt_tokens"] == final.usage.input_tokens  # tokenised as the replica does
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=procs.MODEL, input="x", previous_response_id="resp_1")
    assert info.value.body["param"] == "previous_response_id"


def test_requests_go_only_to_replicas_that_serve_their_features(cluster):
    _, plain, vllm, gateway, _ = cluster
    rows = {r["name"]: r for r in procs.admin(gateway, "/replicas").json()["data"]}
    assert rows[name_of(vllm)]["engine"] == "vllm" and "tools" in rows[name_of(vllm)]["features"]
    assert rows[name_of(plain)]["features"] == []
    body = {"model": FIXTURE_MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PARAMS}}}
    for _ in range(6):
        r = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.headers["x-kvgate-replica"] == name_of(vllm)
    plain_body = {"model": FIXTURE_MODEL, "messages": body["messages"]}
    seen = {httpx.post(gateway.url + "/v1/chat/completions", json={
        **plain_body, "messages": [{"role": "user", "content": f"hi {i} " + "x " * 40 * i}]},
        timeout=30).headers["x-kvgate-replica"] for i in range(12)}
    assert name_of(plain) in seen  # plain requests may still go anywhere


def test_400_only_when_no_replica_of_the_model_can(cluster):
    *_, only_plain = cluster
    body = {"model": FIXTURE_MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(only_plain.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    for extra, param in (({"tools": TOOLS}, "tools"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs")):
        r = httpx.post(only_plain.url + "/v1/chat/completions", json={**body, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    r = httpx.post(only_plain.url + "/v1/responses", json={"model": FIXTURE_MODEL, "input": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"


def test_tools_are_routing_tokens_so_agent_turns_hit_the_cache(cluster):
    replica, _, _, gateway, _ = cluster
    client = sdk(gateway.url)
    cached, decisions = [], []
    for question in ("What is the plan for today?", "And for tomorrow, in detail?"):
        out = client.chat.completions.create(model=procs.MODEL, tools=AGENT_TOOLS, max_tokens=3,
                                             messages=[{"role": "user", "content": question}])
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
        decision = procs.admin(gateway, "/decisions?limit=1").json()["data"][0]
        assert decision["prompt_tokens"] == out.usage.prompt_tokens
        decisions.append(decision)
    assert out.usage.prompt_tokens > 500  # the tool list is most of the prompt
    assert cached[1] >= 400 and decisions[1]["predicted_cached_tokens"] >= 400
    assert decisions[1]["replica"] == name_of(replica)


def test_replica_engines_from_flags_and_file(tmp_path):
    from gateway.config import ConfigError
    from gateway.serve import config_from_args
    from kvgate.cli import build_parser

    config_file = tmp_path / "gw.yaml"
    config_file.write_text("replica_engines:\n  http://b:8000/: sglang\n")
    args = build_parser().parse_args(["gateway", "--replica", "http://a:8000", "--config", str(config_file),
                                      "--replica-engine", "http://a:8000=vllm"])
    assert config_from_args(args).replica_engines == {"http://a:8000": "vllm", "http://b:8000": "sglang"}
    bad = build_parser().parse_args(["gateway", "--replica", "http://a:8000", "--replica-engine", "http://a:8000=tgi"])
    with pytest.raises(ConfigError, match="unknown engines"):
        config_from_args(bad)
