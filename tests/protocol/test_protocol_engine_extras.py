"""vLLM's and SGLang's request extras: mapped onto our sampling, dropped when they ask for
nothing (counted), refused by name when they ask for what we cannot do; a field of no schema
stays `unknown_parameter`."""

from __future__ import annotations

import pytest

from protocol.chat import ChatCompletionRequest
from protocol.completions import CompletionRequest
from protocol.engine_extras import IGNORED
from protocol.errors import APIError
from protocol.parsing import parse_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_sglang_defaults_are_accepted_and_counted():
    before = IGNORED["separate_reasoning"]
    req = parse_request(ChatCompletionRequest, {
        **CHAT, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
        "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True,
        "return_hidden_states": False, "max_completion_tokens": 5, "rid": "r-1", "top_k": -1})
    assert req.max_output_tokens == 5 and req.include_stop_str_in_output is False
    assert IGNORED["separate_reasoning"] == before + 1


def test_mapped_extras_change_sampling():
    req = parse_request(ChatCompletionRequest, {**CHAT, "no_stop_trim": True})
    assert req.include_stop_str_in_output is True
    completion = parse_request(CompletionRequest, {"model": "m", "prompt": "x", "max_completion_tokens": 7})
    assert completion.max_tokens == 7


def test_vllm_extras_at_their_defaults_are_accepted():
    req = parse_request(CompletionRequest, {
        "model": "m", "prompt": "x", "use_beam_search": False, "length_penalty": 1.0,
        "spaces_between_special_tokens": True, "return_token_ids": False, "kv_transfer_params": None,
        "structured_outputs": None, "bad_words": []})
    assert req.max_tokens == 16


@pytest.mark.parametrize("field, value", [("return_hidden_states", True), ("regex", "a+"),
                                          ("use_beam_search", True), ("bad_words", ["x"])])
def test_extras_that_ask_for_more_are_refused_by_name(field, value):
    with pytest.raises(APIError) as err:
        parse_request(CompletionRequest, {"model": "m", "prompt": "x", field: value})
    assert err.value.status_code == 400 and err.value.param == field
    assert err.value.code == "unsupported_parameter"


def test_a_field_of_no_schema_is_still_unknown():
    with pytest.raises(APIError) as err:
        parse_request(ChatCompletionRequest, {**CHAT, "separate_reasonings": True})
    assert err.value.code == "unknown_parameter" and err.value.param == "separate_reasonings"
