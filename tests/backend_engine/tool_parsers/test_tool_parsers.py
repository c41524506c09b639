"""Tool-call parsers: each family's format becomes OpenAI tool calls; a reply streamed in any
chunking yields exactly what the whole reply yields; incomplete or malformed calls stay text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend_engine.tool_parsers import ParsedToolCall, detect, parser_for
from backend_engine.tool_parsers.stream import ToolCallStream

WEATHER = ParsedToolCall("get_weather", '{"city": "Paris", "unit": "C"}')
TIME = ParsedToolCall("get_time", "{}")

REPLIES = {
    "hermes": [
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
         '"unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
         "</tool_call>", "Let me check.", [WEATHER, TIME]),
        ("no tools here, just <b>text</b>", "no tools here, just <b>text</b>", []),
        ('<tool_call>\n{"name": "get_time"', '<tool_call>\n{"name": "get_time"', []),  # cut off
        ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ],
    "llama3_json": [
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; '
         '{"name": "get_time", "parameters": {}}', None, [WEATHER, TIME]),
        ('{"name": "get_time", "arguments": {}}', None, [TIME]),
        ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
        ("Paris is sunny.", "Paris is sunny.", []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, '
         '{"name": "get_time", "arguments": {}}]', None, [WEATHER, TIME]),
        ('Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}[TOOL_CALLS]get_time'
         "[ARGS]{}", "Sure.", [WEATHER, TIME]),
        ('[TOOL_CALLS][{"name": "get_time", "arguments"', '[TOOL_CALLS][{"name": "get_time", '
         '"arguments"', []),
        ("plain answer", "plain answer", []),
    ],
}
CASES = [(name, *case) for name, cases in REPLIES.items() for case in cases]


@pytest.mark.parametrize("parser_name,text,content,calls", CASES)
def test_whole_reply_is_split_into_content_and_calls(parser_name, text, content, calls):
    split = parser_for(parser_name).split(text, final=True)
    assert split.content == content
    assert split.calls == calls


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(1, 400), max_size=30))
def test_any_streaming_of_a_reply_adds_up_to_the_whole(case, cuts):
    parser_name, text, content, calls = case
    stream = ToolCallStream(parser_for(parser_name))
    streamed_content, streamed_calls = "", []
    for cut in sorted(set(cuts)) + [len(text)]:
        delta = stream.feed(text[len(stream.text):cut])
        streamed_content += delta.content
        streamed_calls += delta.calls
        assert all(c in calls for c in delta.calls)  # never a half-parsed call
    final = stream.feed("", final=True)
    streamed_content += final.content
    streamed_calls += final.calls
    assert streamed_calls == calls
    assert streamed_content == (content or "")


def test_content_before_a_call_streams_before_the_call_completes():
    stream = ToolCallStream(parser_for("hermes"))
    assert stream.feed("The weather:").content == "The weather:"
    assert stream.feed(" <tool_").content == ""  # might be a marker: held back
    delta = stream.feed('call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert delta.calls == [TIME] and delta.content == ""


def test_arguments_given_as_json_text_are_accepted_and_normalised():
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    assert parser_for("hermes").split(text, True).calls == [ParsedToolCall("get_time", '{"tz": "UTC"}')]


class _Vocab:
    def __init__(self, *tokens):
        self.tokens = tokens

    def get_vocab(self):
        return {t: i for i, t in enumerate(self.tokens)}


def test_auto_picks_the_parser_from_the_tokenizer():
    assert detect(_Vocab("a", "[TOOL_CALLS]")) == "mistral"
    assert detect(_Vocab("<|python_tag|>", "<|eot_id|>")) == "llama3_json"
    assert detect(_Vocab("<tool_call>")) == "hermes"
    assert detect(_Vocab("hello")) == "hermes"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        parser_for("xml")


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
def test_forced_calls_always_parse_to_schema_valid_arguments(tiny_llm, parser_name):
    import jsonschema

    from backend_engine.sampling_params import SamplingParams
    from backend_engine.structured import StructuredOutputsParams

    weather = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
               "properties": {"city": {"type": "string", "maxLength": 8},
                              "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
    functions = [("get_weather", weather), ("get_time", {"type": "object", "properties": {}})]
    parser = parser_for(parser_name)
    schemas = dict(functions)
    for choice, parallel in (("required", True), ("required", False), ("get_weather", True)):
        tag = parser.forced_format(functions, choice, parallel)
        params = SamplingParams(max_tokens=400, temperature=1.0, seed=11, n=4,
                                structured_outputs=StructuredOutputsParams(structural_tag=tag))
        outputs = tiny_llm.generate("Call a tool:", params)[0].outputs
        # one call is bounded (its arguments' schema and the whitespace bound); parallel calls
        # are not, and a random model may go on calling until max_tokens
        ended = [o for o in outputs if o.finish_reason == "stop"]
        texts = [o.text for o in outputs]
        assert (ended if parallel else len(ended) == 4), texts  # parallel: one of four at least
        for choice_out in ended:
            split = parser.split(choice_out.text, final=True)
            assert split.calls and split.content is None, choice_out.text
            assert parallel or len(split.calls) == 1
            for call in split.calls:
                assert choice in ("required", call.name)
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])


@pytest.mark.parametrize("parser_name,text,content,calls", CASES)
def test_every_single_cut_and_char_by_char_streaming_add_up_to_the_whole(parser_name, text,
                                                                         content, calls):
    """Deterministic sweep beside the property test: a reply cut once at every position (CI's
    hypothesis run once found the cut right after `<|python_tag|>`), and one char at a time."""
    feeds = [[text[:cut], text[cut:]] for cut in range(1, len(text))] + [list(text)]
    for pieces in feeds:
        stream = ToolCallStream(parser_for(parser_name))
        streamed_content, streamed_calls = "", []
        for piece in pieces:
            delta = stream.feed(piece)
            streamed_content += delta.content
            streamed_calls += delta.calls
        final = stream.feed("", final=True)
        assert streamed_calls + final.calls == calls, pieces
        assert streamed_content + final.content == (content or ""), pieces
