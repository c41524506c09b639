"""The async engine: streaming deltas, concurrent requests, abort frees blocks at once."""

import asyncio

import pytest

from backend_engine.async_engine import AsyncLLMEngine
from backend_engine.config import EngineConfig
from backend_engine.errors import ContextLengthExceededError, EngineOverloadedError
from backend_engine.sampling_params import SamplingParams
from routing.hashing import block_hashes, namespace_for


@pytest.fixture(scope="module")
def engine(quantization):
    return AsyncLLMEngine(EngineConfig(enforce_eager=True, model="tiny-random", num_kv_blocks=128,
                                       max_num_batched_tokens=64, quantization=quantization))


async def _collect(engine, rid, tokens, params, **kw):
    deltas, last = [], None
    async for out in engine.generate(tokens, params, rid, **kw):
        deltas.append(out.outputs[0].delta_token_ids)
        last = out
    return deltas, last


async def test_stream_deltas_add_up_to_the_final_output(engine):
    await engine.start()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    deltas, last = await _collect(engine, "s1", list(range(100, 140)), params)
    assert last.finished and len(deltas) == 12
    assert sum(deltas, []) == last.outputs[0].token_ids


async def test_concurrent_requests_match_sequential(engine):
    await engine.start()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [list(range(200 + i, 230 + 3 * i)) for i in range(5)]
    seq = [(await _collect(engine, f"a{i}", p, params))[1].outputs[0].token_ids
           for i, p in enumerate(prompts)]
    results = await asyncio.gather(*[_collect(engine, f"b{i}", p, params)
                                     for i, p in enumerate(prompts)])
    assert [r[1].outputs[0].token_ids for r in results] == seq


async def test_closing_the_stream_aborts_and_frees_blocks(engine):
    await engine.start()
    baseline = engine.num_free_blocks()
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    stream = engine.generate(list(range(300, 364)), params, "abort-me")
    async for _ in stream:
        break
    await stream.aclose()
    for _ in range(100):
        if engine.num_free_blocks() == baseline and engine.load()["running"] == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.num_free_blocks() == baseline
    assert engine.stats.finished_by_reason["abort"] >= 1


async def test_bad_request_raises_before_streaming(engine):
    await engine.start()
    with pytest.raises(ContextLengthExceededError):
        await _collect(engine, "bad", [1] * (engine.max_model_len + 5), SamplingParams())
    deltas, last = await _collect(engine, "good", [1, 2, 3], SamplingParams(max_tokens=2))
    assert last.finished


async def test_kv_events_report_the_prompt_blocks_with_canonical_hashes(engine):
    await engine.start()
    seq0 = engine.kv_snapshot()["seq"]
    prompt = list(range(500, 548))  # 3 full blocks of 16
    await _collect(engine, "ev", prompt, SamplingParams(max_tokens=1), cache_salt="t1")
    events = engine.kv_events_since(seq0)
    stored = [h for e in events for h in e["stored"]]
    expected = block_hashes(prompt, namespace_for(engine.model_id, "t1"), 16)
    assert expected[:2] == stored[:2]  # the third block holds the last prompt token too
    assert set(expected) <= set(engine.kv_snapshot()["blocks"])


async def test_full_waiting_queue_is_refused():
    engine = AsyncLLMEngine(EngineConfig(enforce_eager=True, model="tiny-random", num_kv_blocks=64, max_waiting=0))
    with pytest.raises(EngineOverloadedError):
        await _collect(engine, "x", [1, 2, 3], SamplingParams(max_tokens=1))
    await engine.shutdown()


async def test_the_engine_thread_builds_the_engine_and_runs_its_steps(monkeypatch):
    # one OS thread for every parallel torch op of a replica (OpenMP gives each thread its own
    # team of workers; see async_engine.py)
    import threading

    from backend_engine import engine as engine_module

    threads = []
    real_init, real_step = engine_module.LLMEngine.__init__, engine_module.LLMEngine.step

    def init(self, config):
        threads.append(("init", threading.current_thread().name))
        real_init(self, config)

    def step(self):
        threads.append(("step", threading.current_thread().name))
        return real_step(self)

    monkeypatch.setattr(engine_module.LLMEngine, "__init__", init)
    monkeypatch.setattr(engine_module.LLMEngine, "step", step)
    built = AsyncLLMEngine(EngineConfig(enforce_eager=True, model="tiny-random", num_kv_blocks=32))
    assert not built.is_running  # built, but no step loop before start()
    await built.start()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    await _collect(built, "t1", list(range(10, 20)), params)
    await built.shutdown()
    assert threads[0] == ("init", "kvgate-engine")
    assert {name for kind, name in threads} == {"kvgate-engine"}


async def test_a_model_that_fails_to_load_raises_on_the_caller():
    import threading

    from backend_engine.errors import ModelLoadError

    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ModelLoadError):
        AsyncLLMEngine(EngineConfig(enforce_eager=True, model="/nonexistent/model/folder"))
    assert "kvgate-engine" not in {t.name for t in threading.enumerate()} - before


async def test_a_never_started_engine_shuts_down():
    built = AsyncLLMEngine(EngineConfig(enforce_eager=True, model="tiny-random", num_kv_blocks=16))
    thread = built._thread
    await built.shutdown()
    assert not thread.is_alive()
