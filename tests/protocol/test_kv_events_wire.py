"""The KV event wire format, pinned against the plain msgpack layout vLLM 0.33 and SGLang send."""

from __future__ import annotations

import msgspec
import pytest

from protocol.kv_events import (AllBlocksCleared, BadEventBatch, BatchDecoder, BlockRemoved,
                                BlockStored, KVEventBatch, encode_batch, seq_bytes, seq_of)


def test_batches_encode_as_vllm_map_form():
    batch = KVEventBatch(12.5, [
        BlockStored([b"\x01" * 32], None, [1, 2], 2, None, "GPU", None, extra_keys=[("salt",)]),
        BlockRemoved([7], "GPU"),
        AllBlocksCleared(),
    ], 1)
    plain = [12.5, [
        {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
         "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
         "lora_name": None, "extra_keys": [["salt"]]},
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ], 1]
    assert msgspec.msgpack.decode(encode_batch(batch)) == plain  # same keys, order and values
    assert BatchDecoder().decode(msgspec.msgpack.encode(plain)) == batch


def test_sglang_array_form_decodes_to_the_same_events():
    # SGLang (and vLLM before 0.11): array-like tagged events, no medium, no DP rank.
    payload = msgspec.msgpack.encode([3.0, [
        ["BlockStored", [11, 12], None, list(range(32)), 16, None],
        ["BlockRemoved", [11]],
        ["AllBlocksCleared"],
    ]])
    decoder = BatchDecoder()
    got = decoder.decode(payload)
    assert got.ts == 3.0 and got.data_parallel_rank is None
    assert got.events[0] == BlockStored([11, 12], None, list(range(32)), 16, None, None, None)
    assert got.events[1] == BlockRemoved([11], None)
    assert isinstance(got.events[2], AllBlocksCleared)
    # The decoder keeps working for either form, whichever came last.
    assert decoder.decode(encode_batch(KVEventBatch(1.0, [AllBlocksCleared()]))).ts == 1.0


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode([1.0, [["Nope", 1]]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
])
def test_bad_payloads_raise_a_clear_error(payload):
    with pytest.raises(BadEventBatch, match="not a KV event batch"):
        BatchDecoder().decode(payload)


def test_sequence_numbers_are_8_byte_big_endian():
    assert seq_bytes(258) == b"\x00" * 6 + b"\x01\x02"
    assert seq_of(seq_bytes(-1)) == -1
    with pytest.raises(BadEventBatch):
        seq_of(b"\x01")
