"""Request validation with OpenAI's rules, without an engine."""

import json
import subprocess
import sys

import pytest

from protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest, parse_request
from protocol.errors import APIError
from protocol.parsing import param_from_loc

MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, json.dumps({"model": "m", "messages": MSGS, **fields}).encode())


def rejected(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    assert info.value.status_code == 400
    return info.value


def test_protocol_imports_without_torch():
    code = "import sys, protocol, protocol.http, protocol.sse; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_minimal_chat_request_defaults():
    req = chat()
    assert req.n == 1 and req.stream is False and req.max_output_tokens is None and req.num_logprobs is None
    assert req.template_messages() == [{"role": "user", "content": "hi"}]


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=5, max_completion_tokens=7).max_output_tokens == 7
    assert chat(max_tokens=5).max_output_tokens == 5


def test_text_parts_are_joined_and_other_parts_refused():
    req = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert req.template_messages()[0]["content"] == "ab"
    err = rejected(chat, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert err.param == "messages[0].content[0].type"


def test_roles_and_tool_messages():
    msgs = [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
            {"role": "tool", "content": "r", "tool_call_id": "1"}]
    assert [m["role"] for m in chat(messages=msgs).template_messages()] == ["developer", "user", "assistant", "tool"]
    assert rejected(chat, messages=[{"role": "tool", "content": "r"}]).param == "messages[0].tool_call_id"
    assert rejected(chat, messages=[{"role": "user"}]).param == "messages[0].content"


def test_extra_keys_on_messages_are_tolerated():
    req = chat(messages=[{"role": "assistant", "content": "x", "reasoning_content": "y"}, *MSGS])
    assert "reasoning_content" not in req.template_messages()[0]


@pytest.mark.parametrize("fields,param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"n": 129}, "n"),
    ({"n": 0}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"bogus": 1}}, "stream_options.bogus"),
    ({"stop": ["1", "2", "3", "4", "5"]}, "stop"),
    ({"logit_bias": {"12": 101}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": "7"}, "seed"),
    ({"seed": 2**70}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"whatever": 1}, "whatever"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"modalities": ["audio"]}, "modalities"),
    ({"messages": []}, "messages"),
    ({"model": ""}, "model"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"continue_final_message": True}, "continue_final_message"),
])
def test_invalid_chat_fields_name_their_param(fields, param):
    assert rejected(chat, **fields).param == param


def test_accepted_and_ignored_openai_fields():
    req = chat(user="u", metadata={"k": "v"}, store=False, service_tier="auto", parallel_tool_calls=False,
               reasoning_effort="low", prompt_cache_key="k", safety_identifier="s", response_format={"type": "text"},
               tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none", modalities=["text"])
    assert req.tool_choice == "none"


def test_logprob_settings():
    assert chat(logprobs=True).num_logprobs == 0
    assert chat(logprobs=True, top_logprobs=3).num_logprobs == 3
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage


def test_missing_model_and_malformed_json():
    err = rejected(parse_request, ChatCompletionRequest, json.dumps({"messages": MSGS}).encode())
    assert err.param == "model" and err.code == "missing_required_parameter"
    assert rejected(parse_request, ChatCompletionRequest, b"{nope").code == "invalid_json"
    assert rejected(parse_request, ChatCompletionRequest, b"[1]").code == "invalid_json"
    assert rejected(parse_request, ChatCompletionRequest, b"\xff\xfe").code == "invalid_json"


@pytest.mark.parametrize("prompt,expected", [
    ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_completion_prompt_forms(prompt, expected):
    req = parse_request(CompletionRequest, {"model": "m", "prompt": prompt})
    assert req.prompts() == expected and req.max_tokens == 16


@pytest.mark.parametrize("fields,param", [
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt[0]"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "a", "logprobs": 6}, "logprobs"),
    ({"prompt": "a", "suffix": "b"}, "suffix"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": 5}, "prompt"),
])
def test_invalid_completion_fields(fields, param):
    assert rejected(parse_request, CompletionRequest, {"model": "m", **fields}).param == param


def test_tokenize_needs_exactly_one_input():
    assert parse_request(TokenizeRequest, {"prompt": "x"}).prompt == "x"
    assert parse_request(TokenizeRequest, {"messages": MSGS}).template_messages()[0]["content"] == "hi"
    assert rejected(parse_request, TokenizeRequest, {}).param == "prompt"
    assert rejected(parse_request, TokenizeRequest, {"prompt": "x", "messages": MSGS}).param == "prompt"


def test_param_paths_drop_pydantic_internals():
    assert param_from_loc(("body", "messages", 0, "content", "list[ContentPart]", 1, "text")) == "messages[0].content[1].text"
    assert param_from_loc(("query", "since")) == "since"
    assert param_from_loc(()) is None
