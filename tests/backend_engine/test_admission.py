"""Admission control: a request that would wait past max_queue_delay_s for its first token is
refused with a Retry-After (503 at the HTTP edge), and the refusal leaves nothing behind."""

import asyncio

import httpx
import pytest

from backend_engine.async_engine import AsyncLLMEngine
from backend_engine.config import EngineConfig
from backend_engine.engine import LLMEngine
from backend_engine.errors import EngineOverloadedError
from backend_engine.sampling_params import SamplingParams
from backend_engine.server.settings import ServerSettings
from backend_engine.step_budget import QueueDrain
from tests.backend_engine.helpers import assert_no_leaks
from tests.backend_engine.server.harness import start_server

LONG = SamplingParams(temperature=0, max_tokens=1900, ignore_eos=True)  # busy for seconds


def _config(target_itl_ms: float = 50, **kw) -> EngineConfig:
    return EngineConfig(enforce_eager=True, model="tiny-random", num_kv_blocks=256, max_model_len=2048,
                        target_itl_ms=target_itl_ms, **kw)


async def _first_output(engine, rid, tokens, params):
    stream = engine.generate(tokens, params, rid)
    await stream.__anext__()
    return stream


async def test_an_idle_replica_always_admits():
    engine = AsyncLLMEngine(_config(max_queue_delay_s=1e-9))
    await engine.start()
    try:
        assert engine.queue_delay_s(500) == 0.0
        async for out in engine.generate(list(range(100, 600)), SamplingParams(max_tokens=2),
                                         "solo"):
            pass
        assert out.finished
    finally:
        await engine.shutdown()


async def test_a_request_past_the_queue_bound_is_refused_with_retry_after_and_leaves_nothing():
    engine = AsyncLLMEngine(_config(max_queue_delay_s=1e-9))
    await engine.start()
    try:
        busy = await _first_output(engine, "busy", list(range(100, 140)), LONG)
        with pytest.raises(EngineOverloadedError) as refused:
            async for _ in engine.generate(list(range(200, 260)), LONG, "late"):
                pass
        assert refused.value.retry_after_s >= 1
        assert "late" not in engine.engine.requests
        assert engine.engine.stats.admission_refused == 1
        assert engine.queue_delay_s(60) > 0 and engine.load()["queue_delay_s"] == 0  # queue empty
        await busy.aclose()  # the busy request is aborted when its consumer leaves
        for _ in range(100):
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        assert_no_leaks(engine.engine)
    finally:
        await engine.shutdown()


async def test_without_a_bound_nothing_is_refused():
    engine = AsyncLLMEngine(_config())
    await engine.start()
    try:
        busy = await _first_output(engine, "busy", list(range(100, 140)), LONG)
        async for out in engine.generate(list(range(200, 260)), SamplingParams(max_tokens=3),
                                         "next"):
            pass
        assert out.finished
        await busy.aclose()
    finally:
        await engine.shutdown()


def test_the_http_edge_answers_503_with_retry_after_and_serves_again_after():
    server = start_server(_config(max_queue_delay_s=1e-9), ServerSettings(log_level="warning"))
    chat = server.base_url + "/v1/chat/completions"
    try:
        with httpx.Client(timeout=60) as http:
            body = {"model": "tiny-random", "max_tokens": 1900, "ignore_eos": True, "stream": True,
                    "messages": [{"role": "user", "content": "keep busy"}]}
            with http.stream("POST", chat, json=body) as busy:
                assert busy.status_code == 200
                lines = busy.iter_lines()
                for _ in range(50):  # read on until the engine's load shows the busy request
                    next(lines)
                    if http.get(server.base_url + "/kv/snapshot").json()["load"]["running"] == 1:
                        break
                else:
                    pytest.fail("the busy request never showed in the engine's load")
                r = http.post(chat, json={"model": "tiny-random", "max_tokens": 2,
                                          "messages": [{"role": "user", "content": "hi"}]})
                load = http.get(server.base_url + "/kv/snapshot").json()["load"]
                assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, (r.text, load)
                assert r.json()["error"]["code"] == "engine_overloaded"
            # the floor follows the step-cost model, which learns from every step (the aborted
            # busy request may still be stepping): compare it with a scrape it did not move across
            for _ in range(20):
                floor = http.get(server.base_url + "/kv/snapshot").json()["load"][
                    "prefill_floor_tokens"]
                metrics = http.get(server.base_url + "/metrics").text
                if http.get(server.base_url + "/kv/snapshot").json()["load"][
                        "prefill_floor_tokens"] == floor:
                    break
            assert "kvgate_admission_refused_total 1.0" in metrics
            assert floor >= 32 and f"kvgate_prefill_floor_tokens {float(floor)}" in metrics
            for _ in range(100):
                if http.get(server.base_url + "/kv/snapshot").json()["load"]["running"] == 0:
                    break
            r = http.post(chat, json={"model": "tiny-random", "max_tokens": 2,
                                      "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
    finally:
        server.stop()


def test_a_full_batch_s_queue_rate_does_not_outlive_the_queue():
    """A request that waits while the running batch is full retires nothing, so the measured
    drain rate falls toward 0 (the replica rightly refuses meanwhile); once that request runs
    and nothing waits, the rate is the step budget's estimate again, so the replica admits work
    while it still runs something (it had taken requests only when idle)."""
    engine = LLMEngine(_config(target_itl_ms=0.001, max_queue_delay_s=10.0))
    engine.drain = QueueDrain(half_life_s=0.01)  # a tiny model's steps take milliseconds
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("first", list(range(100, 140)), params)
    engine.add_request("second", list(range(200, 240)), params)
    collapsed = None
    while "first" in engine.requests:
        engine.step()
        if engine.scheduler.waiting:  # the second waits: the batch is full at one row
            collapsed = engine.drain_rate()
    assert collapsed is not None and collapsed < 0.5 * engine.budget.prefill_rate(
        engine.scheduler.decode_load())
    while engine.scheduler.waiting:
        engine.step()
    engine.step()  # a step with nothing waiting
    assert not engine.scheduler.waiting
    assert engine.drain_rate() == pytest.approx(
        engine.budget.prefill_rate(engine.scheduler.decode_load()))
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)
