"""The gateway's small parts on their own: circuit breaker, usage scanning of a passing stream,
tenant salts, config sources, and the tokenizer against the engine's own rendering."""

from __future__ import annotations

import json

import httpx
import pytest

from gateway.admission import tenant_salt
from gateway.circuit import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from gateway.config import ApiKey, ConfigError, GatewayConfig, apply_env, load_file, validate
from gateway.prompt_tokens import PromptTokens
from gateway.tokenizer import LocalTokenizer
from gateway.upstream import UsageScanner
from tests.gateway.procs import tokenizer_folder


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_circuit_opens_after_consecutive_failures_and_allows_one_trial():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=5.0, clock=clock)
    breaker.record_failure()
    assert breaker.allow() and breaker.state == CLOSED
    breaker.record_failure()
    assert breaker.state == OPEN and not breaker.allow()
    clock.now = 5.0
    assert breaker.allow() and breaker.state == HALF_OPEN
    breaker.on_dispatch()
    assert not breaker.allow()  # one trial at a time
    breaker.record_failure()
    assert breaker.state == OPEN and breaker.times_opened == 2
    clock.now = 10.0
    assert breaker.allow()
    breaker.on_dispatch()
    breaker.record_success()
    assert breaker.state == CLOSED and breaker.allow()


def test_usage_scanner_finds_usage_split_across_chunks():
    usage = {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
             "prompt_tokens_details": {"cached_tokens": 32}}
    stream = (b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n'
              + b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
    for cut in (1, 17, len(stream) // 2, len(stream) - 3):
        scanner = UsageScanner()
        scanner.feed(stream[:cut])
        scanner.feed(stream[cut:])
        assert (scanner.usage.prompt_tokens, scanner.usage.cached_tokens) == (40, 32)


def test_gateway_reads_the_whole_prompt_from_messages_usage():
    scanner = UsageScanner()
    start = {"type": "message_start", "message": {"usage": {
        "input_tokens": 8, "output_tokens": 0, "cache_read_input_tokens": 32}}}
    delta = {"type": "message_delta", "usage": {"output_tokens": 5}}  # as vLLM sends it
    for name, payload in (("message_start", start), ("message_delta", delta)):
        scanner.feed(f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode())
    assert (scanner.usage.prompt_tokens, scanner.usage.cached_tokens) == (40, 32)


def test_tenant_salts_never_collide():
    alice, bob = ApiKey("a", "alice", isolate_cache=True), ApiKey("b", "bob", isolate_cache=True)
    shared = ApiKey("c", "carol")
    salts = [tenant_salt(alice, None), tenant_salt(alice, "s"), tenant_salt(bob, None),
             tenant_salt(shared, None), tenant_salt(shared, "tenant:alice"),
             tenant_salt(shared, "salt:tenant:alice"), tenant_salt(None, "s")]
    assert len(set(salts)) == len(salts)
    assert tenant_salt(shared, "plain") == "plain"  # an ordinary salt passes through unchanged


def test_config_file_env_and_validation(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text("policy: least_load\napi_keys:\n  - {key: k1, name: one, rpm: 5}\n")
    config = load_file(path, GatewayConfig())
    apply_env(config, {"KVGATE_API_KEYS": "k2, k3", "KVGATE_ADMIN_KEY": "adm"})
    validate(config)
    assert config.policy == "least_load" and config.admin_key == "adm"
    assert [k.key for k in config.api_keys] == ["k1", "k2", "k3"]
    assert config.api_keys[0].requests_per_minute == 5
    path.write_text("polcy: kvgate\n")
    with pytest.raises(ConfigError, match="polcy"):
        load_file(path, GatewayConfig())
    with pytest.raises(ConfigError):
        validate(GatewayConfig(api_keys=[ApiKey("k", "a|b")]))
    with pytest.raises(ConfigError):
        validate(GatewayConfig(admin_key="same", api_keys=[ApiKey("same", "u")]))


CONVERSATIONS = [
    ([{"role": "user", "content": "Hi"}], {}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🙂"},
      {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "again\n\twith tabs"}], {}),
    ([{"role": "user", "content": "Hi"}], {"add_generation_prompt": False}),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}],
     {"add_generation_prompt": False, "continue_final_message": True}),
]


def test_local_tokenizer_renders_exactly_as_the_engine():
    from transformers import AutoTokenizer

    from backend_engine.chat import encode_prompt, render_chat

    folder = tokenizer_folder()
    theirs, ours = AutoTokenizer.from_pretrained(folder), LocalTokenizer.from_folder(folder)
    for messages, kwargs in CONVERSATIONS:
        assert ours.render_chat(messages, **kwargs) == render_chat(theirs, messages, **kwargs)
    for prompt in ("plain text", "  spaces and ünïcode\n"):
        assert ours.encode_prompt(prompt) == encode_prompt(theirs, prompt)


async def test_parity_check_reports_a_mismatching_replica():
    ours = LocalTokenizer.from_folder(tokenizer_folder())

    def replica(shift: int):
        def handle(request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            tokens = (ours.render_chat(body["messages"]) if "messages" in body
                      else ours.encode_prompt(body["prompt"]))
            return httpx.Response(200, json={"tokens": [t + shift for t in tokens]})
        return httpx.AsyncClient(transport=httpx.MockTransport(handle))

    good, bad = replica(0), replica(1)
    assert await PromptTokens({"m": tokenizer_folder()}, good).check_parity("m", "http://r") == "ok"
    verdict = await PromptTokens({"m": tokenizer_folder()}, bad).check_parity("m", "http://r")
    assert verdict.startswith("mismatch")
    assert await PromptTokens({}, good).check_parity("m", "http://r") == "remote"


async def test_lean_pool_reuses_connections_and_drops_expired_ones():
    import asyncio

    from benchmarks.gateway_overhead import _serve_connection
    from gateway.pool import LeanTransport

    server = await asyncio.start_server(_serve_connection, "127.0.0.1", 0)
    url = "http://127.0.0.1:%d/v1/chat/completions" % server.sockets[0].getsockname()[1]
    transport = LeanTransport(max_idle_per_origin=4, keepalive_expiry=0.2)
    async with server, httpx.AsyncClient(transport=transport) as client:
        for _ in range(5):
            assert (await client.post(url, content=b"{}")).json()["object"] == "chat.completion"
        assert transport.pool.opened == 1
        async with client.stream("POST", url, content=b'{"stream":true}') as r:
            body = b"".join([part async for part in r.aiter_raw()])
        assert body.endswith(b"data: [DONE]\n\n") and transport.pool.opened == 1
        answers = await asyncio.gather(*(client.post(url, content=b"{}") for _ in range(10)))
        assert {a.status_code for a in answers} == {200}
        assert transport.pool.opened == 10 and max(len(s) for s in transport.pool._idle.values()) == 4
        await asyncio.sleep(0.3)  # every idle connection is now past its keep-alive expiry
        assert (await client.post(url, content=b"{}")).status_code == 200
        assert transport.pool.opened == 11
        with pytest.raises(httpx.ConnectError):
            await client.post("http://127.0.0.1:1/", content=b"{}")


def test_routing_hint_is_the_session_header_else_prompt_cache_key_else_user():
    from gateway.admission import routing_hint
    from protocol.chat import ChatCompletionRequest

    def hint(headers: dict, **fields) -> str | None:
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                    **fields)
        return routing_hint(req, headers, "m|tenant:a")

    assert hint({"x-session-id": "s"}, prompt_cache_key="k", user="u") == "m|tenant:a\x00s"
    assert hint({}, prompt_cache_key="k", user="u") == "m|tenant:a\x00k"
    assert hint({}, user="u") == "m|tenant:a\x00u"
    assert hint({}) is None and hint({"x-session-id": ""}) is None
