"""The real Gemma 3 270M checkpoint (its Q4_K_M GGUF as stored) served by `kvgate up --model
gemma3-270m`: two replicas behind a gateway, the official openai SDK through the gateway. Chat,
streaming with usage, a repeated long system prompt answered from the prefix cache (routed to
the replica that holds it), and bad input answered in OpenAI's error format."""

from __future__ import annotations

import openai
import pytest

from benchmarks.serve_bench_cluster import Cluster
from kvgate.launcher.config import UpConfig
from tests.gateway.procs import long_system_prompt

pytestmark = pytest.mark.timeout(420)
MODEL = "gemma3-270m"


@pytest.fixture(scope="module")
def client():
    # replicas start eager (Gemma's layers run eager anyway): no decode step compiled
    config = UpConfig(model=MODEL, replicas=2, gateways=1, num_threads=1, enforce_eager=True,
                      engine={"num_kv_blocks": 512, "max_num_seqs": 8},
                      log_level="warning", health_timeout_s=360.0, shutdown_grace_s=5.0)
    with Cluster(config, say=lambda *a: None) as cluster:
        yield openai.OpenAI(base_url=cluster.base_urls[0], api_key=cluster.api_key or "unused",
                            max_retries=0, timeout=120)


def test_the_gateway_lists_the_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_completion(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 12 and out.usage.prompt_tokens > 5
    # greedy: the same answer again (from the prefix cache this time)
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=12, temperature=0)
    assert again.choices[0].message.content == choice.message.content


def test_a_greedy_completion_continues_the_text(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is",
                                    max_tokens=8, temperature=0)
    assert out.choices[0].text.strip() and out.usage.completion_tokens == 8


def test_streaming_chat_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=10,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens <= 10


def test_a_repeated_system_prompt_is_served_from_the_prefix_cache(client):
    system = long_system_prompt("gemma", words=320)
    cached = []
    for question in ("What is rule 3?", "What is rule 7?"):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": system},
                                   {"role": "user", "content": question}],
            max_tokens=4, temperature=0)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
        prompt_tokens = out.usage.prompt_tokens
    # the second request went to the replica holding the system prompt's blocks
    assert cached[0] == 0 and cached[1] >= 0.8 * prompt_tokens, (cached, prompt_tokens)


@pytest.mark.parametrize("kwargs,param", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=8, temperature=-0.5), "temperature"),
])
def test_bad_input_is_an_openai_error(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], **kwargs)
    assert err.value.status_code == 400 and param in str(err.value)
    # the replica is still serving
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices[0].text


def test_a_prompt_over_the_context_is_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="word " * 40000, max_tokens=4)
    assert err.value.status_code == 400
