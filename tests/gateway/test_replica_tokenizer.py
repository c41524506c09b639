"""The gateway's tokenizer from kvgate replicas (GET /tokenizer/bundle) and remote tokenisation
for replicas without one, in process against replicas answering through a mock transport: the
bundle renders as the engine does, a bundle whose hash differs across replicas of one model is
refused with a log line, oversized or malformed bundles are refused, and /tokenize calls spread
over the least-loaded replicas with a short cache by prompt hash."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

import httpx
import pytest

from backend_engine.server.tokenizer_bundle_routes import build_bundle
from gateway.circuit import CircuitBreaker
from gateway.config import GatewayConfig
from gateway.remote_tokenize import RemoteTokenizer
from gateway.replica_tokenizers import ReplicaTokenizers
from gateway.replicas import Replica
from gateway.state import GatewayState
from gateway.tokenizer import LocalTokenizer
from protocol.tokenizer_bundle import BUNDLE_PATH, TokenizerBundle, content_hash
from tests.gateway.procs import tokenizer_folder

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "héllo 🙂"}]


@pytest.fixture(scope="module")
def engine_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_folder())


@pytest.fixture(scope="module")
def bundle(engine_tokenizer) -> TokenizerBundle:
    return build_bundle(engine_tokenizer, "m", 16)


def serving(bundles: dict[str, bytes | None], seen: list[str] | None = None):
    """Replicas by host: each serves its bundle (None: 404, as vLLM would) and a /tokenize that
    answers with the host's number of calls so far."""
    reference = LocalTokenizer.from_folder(tokenizer_folder())

    def handle(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if seen is not None:
            seen.append(f"{host}{request.url.path}")
        if request.url.path == BUNDLE_PATH:
            payload = bundles.get(host)
            if payload is None:
                return httpx.Response(404, json={"error": {"message": "Not Found"}})
            etag = f'"{content_hash(payload)}"'
            if request.headers.get("if-none-match") == etag:
                return httpx.Response(304, headers={"ETag": etag})
            return httpx.Response(200, content=payload, headers={"ETag": etag})
        body = json.loads(request.content)
        tokens = (reference.render_chat(body["messages"]) if "messages" in body
                  else reference.encode_prompt(body["prompt"]))
        return httpx.Response(200, json={"tokens": tokens})

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


async def test_the_fetched_tokenizer_renders_as_the_engine(bundle, engine_tokenizer):
    from backend_engine.chat import encode_prompt, render_chat

    seen: list[str] = []
    fetched = ReplicaTokenizers(serving({"r1": bundle.encode(), "r2": bundle.encode()}, seen))
    assert await fetched.sync("m", "http://r1", 16) == "loaded"
    assert await fetched.sync("m", "http://r2", 16) == "same"  # confirmed by hash (304)
    ours = fetched.get("m")
    assert ours.render_chat(CHAT) == render_chat(engine_tokenizer, CHAT)
    assert ours.encode_prompt("  spaces ünïcode") == encode_prompt(engine_tokenizer, "  spaces ünïcode")
    assert fetched.digest("m") == content_hash(bundle.encode())


async def test_a_differing_hash_across_replicas_is_refused_with_a_log_line(bundle, caplog):
    other = dataclasses.replace(bundle, chat_template=bundle.chat_template + "{# v2 #}")
    state = GatewayState(GatewayConfig(admin_key="k", prefix_advice=False))
    client = serving({"r1": bundle.encode(), "r2": other.encode()})
    state.tokens.fetched.client = state.tokens.remote.client = client
    replicas = [Replica(name, f"http://{name}", CircuitBreaker(), models=["m"]) for name in ("r1", "r2")]
    try:
        with caplog.at_level(logging.INFO, logger="gateway.state"):
            for replica in replicas:
                await state.check_parity(replica)
        assert replicas[0].parity == "ok"
        assert replicas[1].parity.startswith("mismatch: tokenizer sha256:")
        assert "refused the tokenizer of replica r2 for model m" in caplog.text
        assert "model m: tokenised local (tokenizer from the replicas, sha256:" in caplog.text
        assert state.tokens.fetched.digest("m") == content_hash(bundle.encode())  # kept the first
    finally:
        await state.close()


async def test_a_folder_wins_and_foreign_replicas_leave_the_model_remote(bundle):
    seen: list[str] = []
    client = serving({"r1": bundle.encode()}, seen)
    from gateway.prompt_tokens import PromptTokens

    with_folder = PromptTokens({"m": tokenizer_folder()}, client)
    assert await with_folder.sync_from_replica("m", "http://r1", 16) is None
    assert not seen and with_folder.mode("m").startswith("local (--tokenizer folder")
    foreign = PromptTokens({}, serving({"vllm": None}))
    assert await foreign.sync_from_replica("m", "http://vllm", 16) is None
    assert foreign.local("m") is None and foreign.mode("m").startswith("remote")


@pytest.mark.parametrize("payload", [b"\x80\x04\x95pickle", b"[1, 2]", b'{"format": 1, "model": "m"}'])
async def test_malformed_bundles_are_refused(payload):
    fetched = ReplicaTokenizers(serving({"r": payload}))
    assert (await fetched.sync("m", "http://r", 16)).startswith("unavailable: tokenizer bundle")
    assert fetched.get("m") is None


async def test_an_oversized_bundle_or_another_block_size_is_refused(bundle):
    small = ReplicaTokenizers(serving({"r": bundle.encode()}), max_bytes=1024)
    assert "larger than 1024 bytes" in await small.sync("m", "http://r", 16)
    fetched = ReplicaTokenizers(serving({"r": bundle.encode()}))
    assert (await fetched.sync("m", "http://r", 32)).startswith("mismatch: the replica hashes blocks of 16")
    assert fetched.get("m") is None


async def test_remote_tokenisation_spreads_over_the_least_loaded_replicas():
    calls: list[str] = []
    remote = RemoteTokenizer(serving({}, calls))
    hosts = [f"http://r{i}" for i in range(4)]
    await asyncio.gather(*(remote.tokens([(h, 0) for h in hosts], {"model": "m", "prompt": f"p{i}"})
                           for i in range(40)))
    per_host = {h: sum(c.startswith(h[7:]) for c in calls) for h in hosts}
    assert sum(per_host.values()) == 40 and min(per_host.values()) >= 5, per_host
    calls.clear()
    for i in range(5):  # r0 runs many requests, r3 few: r3 tokenises
        await remote.tokens([("http://r0", 9), ("http://r3", 1)], {"model": "m", "prompt": f"q{i}"})
    assert calls == ["r3/tokenize"] * 5


async def test_remote_tokens_are_cached_by_prompt_and_shared_while_in_flight():
    calls: list[str] = []
    remote = RemoteTokenizer(serving({}, calls))
    body = {"model": "m", "messages": CHAT}
    first = await asyncio.gather(*(remote.tokens([("http://r0", 0), ("http://r1", 0)], body)
                                   for _ in range(5)))
    again = await remote.tokens([("http://r0", 0)], body)
    assert len(calls) == 1 and all(t == again for t in first) and again
