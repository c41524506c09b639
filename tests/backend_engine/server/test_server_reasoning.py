"""Reasoning output through the official openai SDK against replicas of tiny random models whose
chat templates think (tests/backend_engine/reasoning/think_models.py): the parser picked by the
template, `reasoning_content`/`reasoning` in messages and stream deltas, the Responses API's
reasoning item, `enable_thinking` reaching the template, structured outputs held back until
the reasoning ends, and a bad parser name refused at start-up."""

from __future__ import annotations

import json

import openai
import pytest

from backend_engine.config import EngineConfig
from backend_engine.server.app import create_app
from backend_engine.server.settings import ServerSettings
from tests.backend_engine.reasoning.think_models import QWEN3_TEMPLATE, R1_TEMPLATE, think_model
from tests.backend_engine.server.harness import start_server

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
CHOICE = {"structured_outputs": {"choice": ["yes", "no"]}}


def _replica(folder, **settings):
    config = EngineConfig(enforce_eager=True, model=str(folder), num_kv_blocks=64,
                          max_model_len=256, max_num_seqs=4, max_num_batched_tokens=128)
    return start_server(config, ServerSettings(log_level="warning", **settings))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("think")
    r1 = _replica(think_model(root, "tiny-r1", R1_TEMPLATE))
    qwen3 = _replica(think_model(root, "tiny-qwen3", QWEN3_TEMPLATE))
    try:
        yield r1, qwen3
    finally:
        r1.stop()
        qwen3.stop()


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _create(server, **kwargs):
    return sdk(server).chat.completions.create(model=server.engine.model_id, messages=MESSAGES,
                                               max_tokens=8, temperature=0, **kwargs)


def _streamed(server, **kwargs) -> tuple[str, str, str, str | None]:
    reasoning = reasoning_new = content = ""
    finish = None
    for chunk in _create(server, stream=True, **kwargs):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            reasoning_new += extra.get("reasoning") or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning, reasoning_new, content, finish


def test_the_parser_is_picked_by_the_chat_template(servers):
    r1, qwen3 = servers
    assert r1.state.reasoning_parser.name == "deepseek_r1"
    assert qwen3.state.reasoning_parser.name == "qwen3"


def test_r1_thinking_cut_off_is_all_reasoning_streamed_or_not(servers):
    r1, _ = servers
    out = _create(r1)
    message = out.choices[0].message
    thought = message.model_extra["reasoning_content"]
    assert thought and message.model_extra["reasoning"] == thought and message.content is None
    assert out.choices[0].finish_reason == "length"
    assert _streamed(r1) == (thought, thought, "", "length")


def test_include_reasoning_false_leaves_it_out(servers):
    r1, _ = servers
    off = {"include_reasoning": False}
    message = _create(r1, extra_body=off).choices[0].message
    assert message.content is None and message.model_extra["reasoning_content"] is None
    assert _streamed(r1, extra_body=off) == ("", "", "", "length")


def test_enable_thinking_false_reaches_the_template_and_the_answer_is_content(servers):
    _, qwen3 = servers
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    message = _create(qwen3, extra_body=off).choices[0].message
    assert message.content and message.model_extra["reasoning_content"] is None
    assert _streamed(qwen3, extra_body=off) == ("", "", message.content, "length")
    on = _create(qwen3).choices[0].message  # no <think> from the model: content as well
    assert on.content and on.model_extra["reasoning_content"] is None


def test_structured_outputs_wait_for_the_end_of_the_reasoning(servers):
    r1, qwen3 = servers
    held = _create(r1, extra_body=CHOICE)  # the model never ends its reasoning: never held to it
    assert held.choices[0].finish_reason == "length"
    assert held.choices[0].message.model_extra["reasoning_content"] not in ("yes", "no")
    closed = _create(qwen3, extra_body={**CHOICE, "chat_template_kwargs": {"enable_thinking": False}})
    assert closed.choices[0].message.content in ("yes", "no")  # no reasoning: held at once
    assert closed.choices[0].finish_reason == "stop"


def test_responses_api_gives_a_reasoning_item_streamed_or_not(servers):
    r1, _ = servers
    kwargs = dict(model=r1.engine.model_id, input="What is 2 + 2?", max_output_tokens=8,
                  temperature=0)
    response = sdk(r1).responses.create(**kwargs)
    item = response.output[0]
    assert item.type == "reasoning" and len(response.output) == 1
    thought = item.content[0].text
    assert thought == _create(r1).choices[0].message.model_extra["reasoning_content"]
    events = list(sdk(r1).responses.create(stream=True, **kwargs))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == thought and [e.text for e in done] == [thought]
    final = events[-1].response
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == thought


def test_an_unknown_parser_is_refused_at_start_up():
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'; choose from auto, none, "
                                         "deepseek_r1, qwen3"):
        create_app(ServerSettings(reasoning_parser="r1"), lambda: None)


def test_a_template_without_think_tags_gets_no_parser_and_ignores_enable_thinking(client, replica):
    assert replica.state.reasoning_parser is None  # the SmolLM2 template: auto picks none
    out = client.chat.completions.create(
        model=replica.engine.model_id, messages=MESSAGES, max_tokens=4,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert out.choices[0].message.content
    assert json.loads(out.model_dump_json())["choices"][0]["message"]["reasoning_content"] is None


def test_messages_api_gives_thinking_blocks_streamed_or_not(servers):
    import anthropic

    r1, _ = servers
    thought = _create(r1).choices[0].message.model_extra["reasoning_content"]
    claude = anthropic.Anthropic(base_url=r1.base_url, api_key="unused", max_retries=0,
                                 timeout=60)
    kwargs = dict(model=r1.engine.model_id, max_tokens=8, messages=MESSAGES,
                  extra_body={"temperature": 0})
    message = claude.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking"]
    assert message.content[0].thinking == thought and message.stop_reason == "max_tokens"
    with claude.messages.stream(**kwargs) as stream:
        deltas = "".join(e.delta.thinking for e in stream
                         if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
        final = stream.get_final_message()
    assert deltas == thought and final.content[0].thinking == thought
