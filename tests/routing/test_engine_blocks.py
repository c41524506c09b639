"""Foreign engines' blocks land on the canonical hashes a gateway computes for the same prompt,
whatever the engine's own hashes and block size; what cannot be mapped is dropped, never guessed."""

from __future__ import annotations

import hashlib

import pytest

from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from routing.engine_blocks import EngineBlockMap
from routing.event_sequence import EventSequence, Step
from routing.hashing import block_hashes, namespace_for
from routing.index import PrefixIndex

MODEL = "m"
B = 16


def engine_hashes(tokens: list[int], bs: int, salt: bytes = b"vllm") -> list[bytes]:
    """sha256-chained hashes, as vLLM's default (bytes): nothing like ours."""
    out, parent = [], salt
    for i in range(len(tokens) // bs):
        parent = hashlib.sha256(parent + repr(tokens[i * bs:(i + 1) * bs]).encode()).digest()
        out.append(parent)
    return out


def stored(hashes, parent, tokens, bs=B, **kw) -> BlockStored:
    return BlockStored(list(hashes), parent, list(tokens), bs, None, "GPU", kw.pop("lora_name", None), **kw)


def batch(*events, ts: float = 1.0) -> KVEventBatch:
    return KVEventBatch(ts, list(events), 0)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n)]


def test_stored_blocks_map_to_the_gateways_canonical_hashes():
    tokens = prompt(64)
    eh = engine_hashes(tokens, B)
    m = EngineBlockMap(MODEL, B)
    first = m.apply(batch(stored(eh[:2], None, tokens[:32])))
    second = m.apply(batch(stored(eh[2:], eh[1], tokens[32:])))
    assert first.stored + second.stored == block_hashes(tokens, MODEL, B)
    assert len(m) == 4


def test_removed_and_cleared_take_blocks_away():
    tokens = prompt(48)
    eh = engine_hashes(tokens, B)
    canonical = block_hashes(tokens, MODEL, B)
    m = EngineBlockMap(MODEL, B)
    m.apply(batch(stored(eh, None, tokens)))
    changes = m.apply(batch(BlockRemoved([eh[2]], "GPU")))
    assert changes.removed == [canonical[2]] and changes.stored == []
    changes = m.apply(batch(AllBlocksCleared()))
    assert sorted(changes.removed) == sorted(canonical[:2]) and len(m) == 0


@pytest.mark.parametrize("engine_bs", [1, 4, 16, 32, 64])
def test_any_engine_block_size_maps_onto_ours(engine_bs):
    tokens = prompt(128, seed=engine_bs)
    eh = [int.from_bytes(h[:8], "big") for h in engine_hashes(tokens, engine_bs)]
    m = EngineBlockMap(MODEL, B)
    got, parent = [], None
    for i, h in enumerate(eh):  # one BlockStored per page, as SGLang sends them
        got += m.apply(batch(stored([h], parent, tokens[i * engine_bs:(i + 1) * engine_bs], engine_bs))).stored
        parent = h
    assert got == block_hashes(tokens, MODEL, B)
    # Removing an engine block removes exactly the canonical blocks whose last token it held.
    completed = max(1, engine_bs // B)
    assert m.apply(batch(BlockRemoved([eh[-1]], "GPU"))).removed == got[-completed:]


def test_a_partial_last_page_is_completed_by_its_child():
    tokens = prompt(40)
    m = EngineBlockMap(MODEL, B)
    a = m.apply(batch(stored([11], None, tokens[:20], 20))).stored  # 20 tokens: one full block
    b = m.apply(batch(stored([12], 11, tokens[20:40], 20))).stored
    assert a + b == block_hashes(tokens, MODEL, B)


def test_cache_salt_and_lora_name_pick_the_namespace():
    tokens = prompt(32)
    m = EngineBlockMap(MODEL, B)
    salted = m.apply(batch(stored([1, 2], None, tokens, extra_keys=[("tenant:a",), None]))).stored
    assert salted == block_hashes(tokens, namespace_for(MODEL, "tenant:a"), B)
    lora = m.apply(batch(stored([3, 4], None, tokens, lora_name="sql", extra_keys=[("sql",), ("sql",)]))).stored
    assert lora == block_hashes(tokens, "sql", B)


def test_unknown_parents_and_multimodal_blocks_are_dropped_not_guessed():
    tokens = prompt(48)
    m = EngineBlockMap(MODEL, B)
    assert m.apply(batch(stored([7], 999, tokens[:16]))).stored == []
    assert m.stats.unknown_parent == 1
    image = m.apply(batch(stored([8, 9], None, tokens[:32], extra_keys=[None, (["img-1", 0],)])))
    assert image.stored == block_hashes(tokens[:16], MODEL, B)  # the block before the image
    assert m.stats.unmappable == 1
    assert m.apply(batch(stored([10], 9, tokens[32:48]))).stored == []  # child of the image
    assert m.stats.unknown_parent == 2


def test_a_block_held_by_two_ranks_stays_until_both_drop_it():
    tokens = prompt(16)
    m = EngineBlockMap(MODEL, B)
    assert m.apply(batch(stored([1], None, tokens)), rank=0).stored
    assert m.apply(batch(stored([1], None, tokens)), rank=1).stored == []  # already there
    assert m.apply(batch(BlockRemoved([1], "GPU")), rank=0).removed == []
    assert m.clear_rank(1).removed == block_hashes(tokens, MODEL, B)


def test_re_reported_blocks_and_sliding_window_groups_change_nothing():
    tokens = prompt(32)
    m = EngineBlockMap(MODEL, B)
    m.apply(batch(stored([1, 2], None, tokens)))
    assert m.apply(batch(stored([1, 2], None, tokens))).stored == []
    swa = stored([5, 6], None, tokens, group_idx=1, kv_cache_spec_kind="sliding_window")
    assert m.apply(batch(swa)).stored == [] and m.stats.ignored == 2
    assert m.apply(batch(BlockRemoved([1], "GPU"))).removed == block_hashes(tokens, MODEL, B)[:1]


def test_mapping_memory_is_bounded():
    m = EngineBlockMap(MODEL, B, max_blocks=10)
    tokens = prompt(16 * 30)
    m.apply(batch(stored(list(range(30)), None, tokens)))
    assert len(m) == 10 and m.stats.evicted == 20


def test_mapped_blocks_feed_the_same_index_a_kvgate_replica_feeds():
    tokens = prompt(64)
    index = PrefixIndex(B)
    index.add_replica("vllm-0")
    m = EngineBlockMap(MODEL, B)
    changes = m.apply(batch(stored(engine_hashes(tokens, B), None, tokens)))
    index.apply_blocks("vllm-0", changes.stored, changes.removed)
    assert index.match(block_hashes(tokens + [1, 2, 3], MODEL, B), include_predicted=False) == {"vllm-0": 4}


def test_sequence_numbers_classify_gaps_restarts_and_duplicates():
    s = EventSequence()
    assert s.step(41) is Step.APPLY  # joined late: the first number seen is fine
    s.applied(41)
    assert s.step(42) is Step.APPLY
    assert s.step(45) is Step.GAP
    assert s.step(0) is Step.RESTART
    assert s.step(40, replaying=True) is Step.DUPLICATE
