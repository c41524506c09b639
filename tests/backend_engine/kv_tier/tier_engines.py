"""Engines with a KV tier for the tests here: a tiny random model, a 24-block pool, a 96-token
prefix that floods push out of the pool."""

from __future__ import annotations

from pathlib import Path

from backend_engine.config import EngineConfig
from backend_engine.engine import LLMEngine
from backend_engine.sampling_params import SamplingParams
from routing.hashing import block_hashes, namespace_for

PREFIX = [300 + i for i in range(96)]  # 6 full blocks of 16
TURN = PREFIX + [5, 6, 7]


def tier_engine(**tier) -> LLMEngine:
    return LLMEngine(EngineConfig(enforce_eager=True, model="tiny-random", num_kv_blocks=24,
                                  max_num_batched_tokens=128, target_itl_ms=0, **tier))


def add(engine: LLMEngine, rid: str, tokens: list[int], salt: str | None = None) -> None:
    engine.add_request(rid, tokens, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       cache_salt=salt)


def run(engine: LLMEngine, rid: str, tokens: list[int], salt: str | None = None):
    """The request's greedy tokens and cached tokens, stepping the engine until it ends."""
    add(engine, rid, tokens, salt)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.outputs[0].token_ids, out.num_cached_tokens


def prefix_hashes(engine: LLMEngine, salt: str | None = None) -> list[int]:
    return block_hashes(PREFIX, namespace_for(engine.model_id, salt), 16)


def flood(engine: LLMEngine, n: int = 8) -> None:
    for i in range(n):  # 8 x 6 blocks through a 24-block pool: PREFIX leaves the pool
        run(engine, f"flood-{i}", [2000 + 131 * i + j for j in range(96)])


def disk_tier_after_a_flood(folder: Path) -> list[int]:
    """Serve PREFIX, push it out of the pool onto disk, stop; the tier's hashes."""
    engine = tier_engine(kv_offload_dir=str(folder))
    try:
        run(engine, "first", PREFIX + [1])
        flood(engine)
        engine.pool.tier.disk.flush()
        return engine.pool.tier_hashes()
    finally:
        engine.close()
