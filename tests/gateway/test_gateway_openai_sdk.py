"""The official openai SDK pointed at the gateway in front of two real tiny replicas: every
answer has the shape a direct replica call has."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.gateway import procs

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster():
    with procs.two_replicas_and_gateway() as running:
        yield running


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def shape(value):
    """The structure of a response: keys and value types, without the values."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items() if k not in ("id", "created")}
    if isinstance(value, list):
        return [shape(v) for v in value[:1]]
    return type(value).__name__


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


def test_models_are_the_union_of_the_replicas(cluster):
    replicas, gw = cluster
    direct = sdk(replicas[0].url).models.list()
    via = sdk(gw.url).models.list()
    assert [m.id for m in via.data] == [m.id for m in direct.data] == [procs.MODEL]
    assert sdk(gw.url).models.retrieve(procs.MODEL).id == procs.MODEL
    with pytest.raises(openai.NotFoundError):
        sdk(gw.url).models.retrieve("missing-model")


def test_chat_completion_has_the_replica_shape(cluster):
    replicas, gw = cluster
    direct = sdk(replicas[0].url).chat.completions.create(model=procs.MODEL, messages=CHAT, max_tokens=5, seed=1)
    via = sdk(gw.url).chat.completions.create(model=procs.MODEL, messages=CHAT, max_tokens=5, seed=1)
    assert shape(via.model_dump()) == shape(direct.model_dump())
    assert via.object == "chat.completion" and via.usage.completion_tokens == 5
    assert via.usage.prompt_tokens_details is not None
    # Same seed, same prompt, same weights: the text does not depend on the path taken.
    assert via.choices[0].message.content == direct.choices[0].message.content


def test_completion_with_n_choices(cluster):
    _, gw = cluster
    out = sdk(gw.url).completions.create(model=procs.MODEL, prompt="Once upon a time", max_tokens=4, n=3, seed=7, temperature=1.0)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 12


def test_chat_stream_with_usage_matches_a_direct_stream(cluster):
    replicas, gw = cluster

    def run(base):
        chunks = list(sdk(base).chat.completions.create(
            model=procs.MODEL, messages=CHAT, max_tokens=6, seed=3, stream=True,
            stream_options={"include_usage": True}))
        return chunks

    direct, via = run(replicas[1].url), run(gw.url)
    assert [shape(c.model_dump()) for c in via] == [shape(c.model_dump()) for c in direct]
    assert via[0].choices[0].delta.role == "assistant"
    assert via[-1].choices == [] and via[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in via if c.choices)
    assert text == "".join(c.choices[0].delta.content or "" for c in direct if c.choices)


def test_completion_stream_with_n(cluster):
    _, gw = cluster
    chunks = list(sdk(gw.url).completions.create(model=procs.MODEL, prompt="abc", max_tokens=3, n=2,
                                                 stream=True, stream_options={"include_usage": True}))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert chunks[-1].usage.completion_tokens == 6


def test_errors_are_openai_errors(cluster):
    replicas, gw = cluster
    client = sdk(gw.url)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=procs.MODEL, messages=CHAT, temperature=5)
    assert bad.value.body["param"] == "temperature"
    # Malformed JSON: 400 with the OpenAI error object, never FastAPI's 422.
    for base in (gw.url, replicas[0].url):
        r = httpx.post(base + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # Too long for the replica: its 400 passes through unchanged, with no retry.
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=procs.MODEL, prompt=[1] * 2040, max_tokens=100)
    assert long.value.body["code"] == "context_length_exceeded"


def test_body_over_the_limit_is_413_before_any_replica(cluster):
    _, gw = cluster
    before = procs.admin(gw, "/summary").json()["requests"]
    r = httpx.post(gw.url + "/v1/completions", content=b'{"model":"x","prompt":"' + b"a" * (9 << 20) + b'"}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert procs.admin(gw, "/summary").json()["requests"] == before


def test_metrics_are_exposed(cluster):
    _, gw = cluster
    text = httpx.get(gw.url + "/metrics").text
    for name in ("kvgate_gateway_requests_total", "kvgate_gateway_routing_decisions_total",
                 "kvgate_gateway_routing_latency_seconds", "kvgate_gateway_time_to_first_token_seconds",
                 "kvgate_gateway_circuit_state", "kvgate_gateway_index_entries", "kvgate_gateway_redis_state"):
        assert name in text
