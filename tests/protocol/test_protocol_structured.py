"""Structured outputs, tools and the Responses API at the edge (both edges run these checks):
well-formed requests parse, bad schemas and tool definitions are 400s naming the field, a
Responses request becomes the chat request both edges render, and templates without tool
support still show the model its tools."""

import json
import subprocess
import sys

import pytest

from protocol import ChatCompletionRequest, CompletionRequest, parse_request
from protocol.errors import APIError
from protocol.features import JSON_SCHEMA, RESPONSES, STRUCTURED_OUTPUTS, TOOLS, required_features
from protocol.responses import ResponsesRequest
from protocol.tool_prompt import adapt_to_template

MSGS = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}


def chat(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, json.dumps({"model": "m", "messages": MSGS, **fields}).encode())


def responses(**fields) -> ResponsesRequest:
    return parse_request(ResponsesRequest, {"model": "m", "input": "hi", **fields})


def rejected(fn, **fields) -> APIError:
    with pytest.raises(APIError) as info:
        fn(**fields)
    assert info.value.status_code == 400
    return info.value


def test_new_protocol_modules_import_without_torch():
    code = ("import sys, protocol.responses, protocol.response_objects, "
            "protocol.features, protocol.tool_prompt; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_openai_sdk_shapes_parse():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    req = chat(response_format={"type": "json_schema", "json_schema": {"name": "A", "schema": schema,
                                                                       "strict": True}},
               tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
               parallel_tool_calls=False)
    assert req.response_format.json_schema.json_schema == schema
    assert req.tool_choice_name == "get_weather"
    assert req.template_tools() == [WEATHER]
    assert chat(tools=[WEATHER]).tool_choice_name == "auto"  # OpenAI's default with tools
    assert chat().tool_choice_name == "none"
    assert chat(structured_outputs={"regex": "[a-z]+"}).structured_outputs.constraint() == {"regex": "[a-z]+"}
    completion = parse_request(CompletionRequest, {"model": "m", "prompt": "x",
                                                   "structured_outputs": {"choice": ["a", "b"]}})
    assert completion.structured_outputs.constraint() == {"choice": ["a", "b"]}


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strang"}}}},
     "response_format.json_schema.schema.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "object", "required": "a"}}}}}},
     "response_format.json_schema.schema.properties.a.required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"anyOf": []}}}},
     "response_format.json_schema.schema.anyOf"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": [""]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}]},
     "tools[0].function.parameters.properties"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_formats_and_tools_name_the_field(fields, param):
    assert rejected(chat, **fields).param == param


def test_features_a_request_needs():
    assert required_features(chat(), "chat") == frozenset()
    assert required_features(chat(tools=[WEATHER], tool_choice="none"), "chat") == frozenset()
    assert required_features(chat(tools=[WEATHER]), "chat") == {TOOLS}
    assert required_features(chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}},
                                  structured_outputs=None), "chat") == {JSON_SCHEMA}
    assert required_features(chat(structured_outputs={"choice": ["a"]}), "chat") == {STRUCTURED_OUTPUTS}
    assert required_features(responses(tools=[{"type": "function", "name": "f"}]), "responses") == \
        {RESPONSES, TOOLS}


def test_responses_input_items_become_the_chat_conversation():
    req = responses(instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ], tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=50,
        text={"format": {"type": "json_schema", "name": "W", "schema": {"type": "object"}, "strict": True}})
    as_chat = req.to_chat()
    assert as_chat.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    assert as_chat.tool_choice_name == "get_weather"
    assert as_chat.max_output_tokens == 50
    assert as_chat.response_format.json_schema.name == "W"
    assert as_chat.template_tools() == [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("fields,param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools[0].parameters.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}, "text.format.schema.type"),
    ({"background": True}, "background"),
])
def test_bad_responses_requests_name_the_field(fields, param):
    def build(**f):
        return responses(**f).to_chat()
    assert rejected(build, **fields).param == param


def test_templates_without_tools_get_them_in_the_system_message():
    tools = [WEATHER]
    history = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    messages, left = adapt_to_template("{{ messages }}", history, tools)
    assert left is None
    assert messages[0]["content"].startswith("Be kind.\n\n# Tools") and '"get_weather"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert history[0]["content"] == "Be kind."  # the caller's messages are not modified
    native = "{% for t in tools %}{{ t }}{% endfor %}{{ m.tool_calls }}"
    assert adapt_to_template(native, history, tools) == (history, tools)
    messages, _ = adapt_to_template("{{ messages }}", history[1:2], tools)
    assert messages[0]["role"] == "system" and messages[1] == history[1]


def test_the_whitespace_option_stands_alone_or_beside_a_constraint():
    alone = chat(response_format={"type": "json_object"},
                 structured_outputs={"disable_any_whitespace": False})
    assert alone.structured_outputs.disable_any_whitespace is False
    assert not alone.structured_outputs.has_constraint
    both = chat(structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True})
    assert both.structured_outputs.constraint() == {"json": {"type": "object"}}
    assert rejected(chat, structured_outputs={"disable_any_whitespace": "no"}).param \
        == "structured_outputs.disable_any_whitespace"
