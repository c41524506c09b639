"""Pinned prefixes through the async engine (tiny random model): warm, survive, refuse, unpin."""

import pytest

from backend_engine.async_engine import AsyncLLMEngine
from backend_engine.config import EngineConfig
from backend_engine.errors import InvalidRequestError
from backend_engine.pins import PinCapacityError
from backend_engine.sampling_params import SamplingParams

PREFIX = list(range(300, 364))  # 64 tokens: 4 full blocks of 16


def _engine(quantization: str | None, policy: str = "slru") -> AsyncLLMEngine:
    return AsyncLLMEngine(EngineConfig(enforce_eager=True, model="tiny-random", num_kv_blocks=48,
                                       quantization=quantization,
                                       max_num_batched_tokens=128, eviction_policy=policy,
                                       max_pinned_fraction=0.25))


async def _cached_tokens(engine: AsyncLLMEngine, rid: str, tokens: list[int]) -> int:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    last = None
    async for out in engine.generate(tokens, params, rid):
        last = out
    return last.num_cached_tokens


async def _flood(engine: AsyncLLMEngine, n: int) -> None:
    for i in range(n):
        await _cached_tokens(engine, f"flood-{i}", [1000 + 97 * i + j for j in range(64)])


async def test_a_pinned_prefix_survives_a_flood_and_unpinning_releases_it(quantization):
    engine = _engine(quantization)
    await engine.start()
    try:
        view = await engine.pin("sys", PREFIX, excerpt="system")
        assert view["state"] == "pinned" and view["num_blocks"] == 4
        assert engine.load()["pinned_blocks"] == 4
        await _flood(engine, 30)  # 120 blocks through a 48-block pool
        assert await _cached_tokens(engine, "after", PREFIX + [7, 8, 9]) == 64
        assert await engine.pin("sys", PREFIX) == engine.pins()[0]  # idempotent
        assert await engine.unpin("sys") is True
        assert await engine.unpin("sys") is False
        assert engine.pin_capacity()["pinned_blocks"] == 0
        pool = engine.engine.pool
        assert pool.num_free_blocks == pool.num_blocks  # nothing leaked
    finally:
        await engine.shutdown()


async def test_without_a_pin_plain_lru_loses_the_prefix_in_the_same_flood(quantization):
    engine = _engine(quantization, "lru")
    await engine.start()
    try:
        await _cached_tokens(engine, "first", PREFIX + [1])
        await _flood(engine, 30)
        assert await _cached_tokens(engine, "after", PREFIX + [7, 8, 9]) == 0
    finally:
        await engine.shutdown()


async def test_bad_pins_are_refused_and_change_nothing(quantization):
    engine = _engine(quantization)
    await engine.start()
    try:
        with pytest.raises(InvalidRequestError, match="full block"):
            await engine.pin("short", list(range(10)))
        with pytest.raises(PinCapacityError, match="pinnable blocks"):
            await engine.pin("huge", list(range(500, 500 + 16 * 13)))  # 13 > 12 pinnable
        await engine.pin("a", PREFIX)
        with pytest.raises(InvalidRequestError, match="different prefix"):
            await engine.pin("a", list(range(600, 664)))
        assert [p["id"] for p in engine.pins()] == ["a"]
        assert engine.pin_capacity()["pinned_blocks"] == 4
        pool = engine.engine.pool
        assert pool.num_free_blocks == pool.num_blocks - 4
    finally:
        await engine.shutdown()


async def test_requests_are_sized_to_the_pool_less_the_pins_they_do_not_share(quantization):
    engine = _engine(quantization)  # 48 blocks, 12 pinnable
    await engine.start()
    try:
        pinned = list(range(700, 700 + 16 * 12))
        await engine.pin("big", pinned)
        other = list(range(5000, 5000 + 16 * 40))  # 40 blocks: more than the 36 unpinned ones
        with pytest.raises(InvalidRequestError, match="pinned prefixes"):
            await _cached_tokens(engine, "too-big", other)
        sharing = pinned + list(range(9000, 9000 + 16 * 28 - 4))  # 40 blocks, 12 of them pinned
        assert await _cached_tokens(engine, "fits", sharing) == 16 * 12
    finally:
        await engine.shutdown()


async def test_a_pin_that_would_starve_a_request_in_flight_is_refused(quantization):
    engine = _engine(quantization)  # 48 blocks, 12 pinnable
    await engine.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=16 * 20, ignore_eos=True)
        long_run = engine.generate(list(range(4000, 4000 + 16 * 20)), params, "long")  # 40 blocks
        first = await anext(long_run)  # admitted and running
        assert not first.finished
        with pytest.raises(PinCapacityError, match="in flight"):
            await engine.pin("big", list(range(700, 700 + 16 * 12)))
        await engine.pin("small", PREFIX)  # 4 blocks: 48 - 4 still holds the 40
        async for out in long_run:
            last = out
        assert last.finished and len(last.outputs[0].token_ids) == 16 * 20
    finally:
        await engine.shutdown()
