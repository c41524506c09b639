"""Reasoning output through the gateway: a replica of a tiny model with a DeepSeek-R1-like
template splits its thinking into `reasoning_content`/`reasoning`; the gateway passes those
fields through untouched, in the message and in stream deltas, and routes by the same prompt
tokens the replica renders (`chat_template_kwargs` included)."""

from __future__ import annotations

import openai
import pytest

from tests.backend_engine.reasoning.think_models import R1_TEMPLATE, think_model
from tests.gateway import procs

pytestmark = pytest.mark.timeout(300)
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = think_model(tmp_path_factory.mktemp("think"), "tiny-r1", R1_TEMPLATE)
    replica = procs.replica(None, "--model", str(folder)).start()
    gateway = procs.gateway([replica.url], "--tokenizer", f"tiny-r1={folder}",
                            local_tokenizer=False).start()
    try:
        yield replica, gateway
    finally:
        gateway.stop()
        replica.stop()


def _answers(proc: procs.Proc) -> tuple[dict, tuple[str, str, str]]:
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kwargs = dict(model="tiny-r1", messages=MESSAGES, max_tokens=8, temperature=0)
    message = client.chat.completions.create(**kwargs).choices[0].message.model_dump()
    pieces = ["", "", ""]
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            pieces[0] += extra.get("reasoning_content") or ""
            pieces[1] += extra.get("reasoning") or ""
            pieces[2] += choice.delta.content or ""
    return message, tuple(pieces)


def test_reasoning_fields_pass_through_the_gateway_streamed_or_not(cluster):
    replica, gateway = cluster
    direct, via = _answers(replica), _answers(gateway)
    assert via == direct
    message, (streamed, streamed_new, content) = via
    assert message["reasoning_content"] and message["reasoning"] == message["reasoning_content"]
    assert message["content"] is None and (streamed, streamed_new, content) == (
        message["reasoning_content"], message["reasoning_content"], "")
