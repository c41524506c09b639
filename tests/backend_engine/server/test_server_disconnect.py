"""A client that goes away aborts its request at once; its KV blocks return to the pool."""

import asyncio
import time

import httpx
import pytest

from tests.backend_engine.server.conftest import MODEL
from tests.backend_engine.server.harness import wait_until

LONG = {"model": MODEL, "prompt": "Tell me a long story " * 8, "max_tokens": 400, "ignore_eos": True}


def idle_free_blocks(replica) -> int:
    assert wait_until(lambda: replica.engine.load()["running"] == 0 and replica.engine.load()["waiting"] == 0)
    return replica.engine.num_free_blocks()


def aborted(replica) -> int:
    return replica.engine.stats.finished_by_reason.get("abort", 0)


def test_stream_disconnect_frees_blocks(replica, http):
    baseline, aborts = idle_free_blocks(replica), aborted(replica)
    with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()
        got = [line for _, line in zip(range(6), lines)]
        assert any(line.startswith("data: ") for line in got)
        assert replica.engine.num_free_blocks() < baseline  # the request holds blocks now
        closed_at = time.monotonic()
    assert wait_until(lambda: replica.engine.num_free_blocks() == baseline, timeout_s=2.0)
    assert time.monotonic() - closed_at < 2.0
    assert wait_until(lambda: aborted(replica) == aborts + 1)


def test_non_stream_disconnect_frees_blocks(replica):
    baseline, aborts = idle_free_blocks(replica), aborted(replica)
    with httpx.Client(base_url=replica.base_url, timeout=httpx.Timeout(30, read=0.5)) as short:
        with pytest.raises(httpx.ReadTimeout):
            short.post("/v1/completions", json=LONG)
    assert wait_until(lambda: replica.engine.num_free_blocks() == baseline, timeout_s=2.0)
    assert wait_until(lambda: aborted(replica) == aborts + 1)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_before_first_token_cancels_at_once(replica, monkeypatch, stream):
    """While a request waits for its first output (queued), no bytes flow; a departed client
    must still be noticed at once rather than when the first token would be written."""
    real_generate = replica.engine.generate
    closed: list[float] = []

    async def queued_generate(*args, **kwargs):
        try:
            await asyncio.sleep(30)  # stands in for a long wait in the engine's queue
            async for out in real_generate(*args, **kwargs):
                yield out
        finally:
            closed.append(time.monotonic())

    monkeypatch.setattr(replica.engine, "generate", queued_generate)
    with httpx.Client(base_url=replica.base_url, timeout=httpx.Timeout(30, read=0.3)) as short:
        with pytest.raises(httpx.ReadTimeout):
            short.post("/v1/completions", json={**LONG, "stream": stream})
        gone_at = time.monotonic()
    assert wait_until(lambda: bool(closed), timeout_s=2.0)
    assert closed[0] - gone_at < 1.0
