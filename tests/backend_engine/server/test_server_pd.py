"""The replica's HTTP halves of a prefill/decode pair, driven as the gateway drives them: the
prefill half answers with the first tokens once the decode replica has the blocks; the decode
half streams an ordinary OpenAI response identical to a `both` replica's. Bad or misdirected
kv_transfer_params are a 400; a failed transfer is a 503 the gateway can fail over on."""

import json
import uuid

import httpx
import pytest

from backend_engine.config import EngineConfig
from backend_engine.server.settings import ServerSettings
from tests.backend_engine.server.harness import start_server, wait_until

PROMPT = "The quick brown fox jumps over the lazy dog. " * 12


def _config(role: str) -> EngineConfig:
    return EngineConfig(enforce_eager=True, model="tiny-random", num_kv_blocks=96, max_model_len=512, kv_role=role,
                        num_threads=1, kv_transfer_timeout_s=1.0)


@pytest.fixture(scope="module")
def replicas():
    started = {role: start_server(_config(role), ServerSettings(log_level="warning"))
               for role in ("both", "prefill", "decode")}
    yield started
    for server in started.values():
        server.stop()


def _body(stream=False, **extra) -> dict:
    return {"model": "tiny-random", "messages": [{"role": "user", "content": PROMPT}],
            "temperature": 0, "max_tokens": 8, "stream": stream, **extra}


def _free(server) -> bool:
    load = server.engine.load()
    return load["num_free_blocks"] == load["num_total_blocks"] and not load["kv_transfer"]["held_blocks"]


def _prefill(replicas, body: dict) -> httpx.Response:
    decode = replicas["decode"].engine.kv_transfer_info()["kv_transfer_address"]
    params = {"do_remote_decode": True, "transfer_id": uuid.uuid4().hex, "remote_address": decode}
    unstreamed = {k: v for k, v in body.items() if k != "stream_options"}
    return httpx.post(replicas["prefill"].base_url + "/v1/chat/completions",
                      json={**unstreamed, "stream": False, "kv_transfer_params": params}, timeout=60)


def _decode_body(body: dict, answer: dict) -> dict:
    kv = answer["kv_transfer_params"]
    return {**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": kv["transfer_id"],
                                           "first_tokens": kv["first_tokens"],
                                           "cached_tokens": kv["cached_tokens"]}}


def _stream_text(response: httpx.Response) -> tuple[str, dict | None]:
    text, usage = "", None
    for line in response.iter_lines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
    return text, usage


def test_streamed_pd_response_matches_a_both_replica(replicas):
    body = _body(stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", replicas["both"].base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        expected, _ = _stream_text(r)
    answer = _prefill(replicas, body)
    assert answer.status_code == 200, answer.text
    kv = answer.json()["kv_transfer_params"]
    assert kv["transfer"]["blocks_sent"] > 0 and kv["transfer"]["bytes"] > 0
    with httpx.stream("POST", replicas["decode"].base_url + "/v1/chat/completions",
                      json=_decode_body(body, answer.json()), timeout=60) as r:
        assert r.status_code == 200
        text, usage = _stream_text(r)
    assert text == expected
    assert usage["completion_tokens"] == 8
    assert wait_until(lambda: _free(replicas["prefill"]) and _free(replicas["decode"]))


def test_non_streamed_decode_half(replicas):
    body = _body()
    expected = httpx.post(replicas["both"].base_url + "/v1/chat/completions", json=body, timeout=60).json()
    answer = _prefill(replicas, body).json()
    got = httpx.post(replicas["decode"].base_url + "/v1/chat/completions",
                     json=_decode_body(body, answer), timeout=60).json()
    assert got["choices"][0]["message"] == expected["choices"][0]["message"]


def test_prometheus_shows_roles_and_transfers(replicas):
    _prefill(replicas, _body())
    sent = httpx.get(replicas["prefill"].base_url + "/metrics").text
    received = httpx.get(replicas["decode"].base_url + "/metrics").text
    assert 'kvgate_replica_role{role="prefill"} 1.0' in sent
    assert 'kvgate_kv_transfer_bytes_total{direction="sent"}' in sent
    assert "kvgate_kv_transfer_seconds_count" in sent
    assert 'kvgate_kv_transfer_blocks_total{direction="received"}' in received


def test_snapshot_advertises_role_and_address(replicas):
    snap = httpx.get(replicas["decode"].base_url + "/kv/snapshot").json()
    assert snap["role"] == "decode" and snap["kv_transfer_address"].startswith("tcp://127.0.0.1:")
    assert httpx.get(replicas["both"].base_url + "/kv/snapshot").json()["role"] == "both"


@pytest.mark.parametrize("params, param", [
    ({"transfer_id": "a"}, "kv_transfer_params"),
    ({"do_remote_decode": True, "transfer_id": "a"}, "kv_transfer_params.remote_address"),
    ({"do_remote_prefill": True, "transfer_id": "a b"}, "kv_transfer_params.transfer_id"),
    ({"do_remote_prefill": True, "transfer_id": "a", "first_tokens": [{"token_id": -1}]},
     "kv_transfer_params.first_tokens[0].token_id"),
])
def test_malformed_kv_transfer_params_are_a_400(replicas, params, param):
    r = httpx.post(replicas["decode"].base_url + "/v1/chat/completions",
                   json=_body(kv_transfer_params=params), timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_misdirected_halves_are_a_400_and_leak_nothing(replicas):
    prefill_half = {"do_remote_decode": True, "transfer_id": "x", "remote_address": "tcp://127.0.0.1:9"}
    r = httpx.post(replicas["decode"].base_url + "/v1/chat/completions",
                   json=_body(kv_transfer_params=prefill_half), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_role"
    r = httpx.post(replicas["prefill"].base_url + "/v1/chat/completions",
                   json=_body(stream=True, kv_transfer_params=prefill_half), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    wrong_n = {"do_remote_prefill": True, "transfer_id": "x", "first_tokens": [{"token_id": 5}]}
    r = httpx.post(replicas["decode"].base_url + "/v1/chat/completions",
                   json=_body(n=2, kv_transfer_params=wrong_n), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    assert wait_until(lambda: _free(replicas["decode"]) and _free(replicas["prefill"]))


def test_unreachable_decode_replica_is_a_503_kv_transfer_failed(replicas):
    body = _body()
    params = {"do_remote_decode": True, "transfer_id": uuid.uuid4().hex,
              "remote_address": "tcp://127.0.0.1:9"}  # nothing listens there
    r = httpx.post(replicas["prefill"].base_url + "/v1/chat/completions",
                   json={**body, "kv_transfer_params": params}, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "kv_transfer_failed"
    assert wait_until(lambda: _free(replicas["prefill"]))


def test_decode_half_with_an_unknown_transfer_computes_the_prompt_itself(replicas):
    body = _body()
    expected = httpx.post(replicas["both"].base_url + "/v1/chat/completions", json=body, timeout=60).json()
    answer = _prefill(replicas, body).json()
    answer["kv_transfer_params"]["transfer_id"] = "never-sent"
    got = httpx.post(replicas["decode"].base_url + "/v1/chat/completions",
                     json=_decode_body(body, answer), timeout=60).json()
    assert got["choices"][0]["message"] == expected["choices"][0]["message"]


def test_first_token_logprobs_must_be_finite_and_in_the_vocabulary(replicas):
    for first in ({"token_id": 5, "logprob": 0.5},
                  {"token_id": 5, "logprob": -1.0, "top_logprobs": [{"token_id": 10**9, "logprob": -1.0}]}):
        params = {"do_remote_prefill": True, "transfer_id": "x", "first_tokens": [first]}
        r = httpx.post(replicas["decode"].base_url + "/v1/chat/completions",
                       json=_body(logprobs=True, top_logprobs=1, kv_transfer_params=params), timeout=30)
        assert r.status_code == 400, r.text
    raw = ('{"model":"tiny-random","messages":[{"role":"user","content":"hi"}],"kv_transfer_params":'
           '{"do_remote_prefill":true,"transfer_id":"x","first_tokens":[{"token_id":5,"logprob":NaN}]}}')
    r = httpx.post(replicas["decode"].base_url + "/v1/chat/completions", content=raw,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
