"""vLLM's KV event wire format (msgpack via msgspec), as `vllm/distributed/kv_events.py` defines
it (vLLM 0.33), and the older array form SGLang and earlier vLLM releases send.

A publisher sends one ZMQ multipart message per engine step: `(topic, seq as 8-byte big-endian,
payload)`, where payload is a msgpack `KVEventBatch`: `[ts, [event…], data_parallel_rank]`.
Events are tagged structs. Current vLLM (0.33 checked) encodes them as maps (`{"type": "BlockStored", …}`);
SGLang and older vLLM as arrays (`["BlockStored", block_hashes, parent, token_ids, …]`). Both
decode here into the same classes.

The structs are written field for field after vLLM's rather than imported from the `vllm` wheel:
`vllm.distributed.kv_events` imports `vllm.v1.core.kv_cache_utils`, which imports vLLM's whole
config system, request and multimodal layers and (through `vllm/__init__`) torch with vLLM's
environment overrides; installing the wheel would also replace the pinned torch with its CUDA
build. A gateway must load none of that. The wire format is the contract; the tests pin it
against the plain msgpack layout vLLM sends.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

# vLLM's ExternalBlockHash: sha256 digests (bytes) by default, 64-bit ints when
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is set; SGLang sends ints.
ExternalBlockHash = Union[bytes, int]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"  # vLLM's: host memory (a CPU engine's pool, or the tier below a GPU pool)
MEDIUM_CPU_TIER = "CPU_TIER"  # kvgate's: host-memory KV tier below a CPU engine's pool
MEDIUM_DISK = "DISK"  # kvgate's: a KV tier on disk only
TIER_MEDIA = (MEDIUM_CPU_TIER, MEDIUM_DISK)  # media that are a tier below a pool, never a pool
END_SEQ = -1  # a replay answer ends with this sequence number (8 bytes, signed)


class BadEventBatch(ValueError):
    """A message that is not a KV event batch of either wire form."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events (map form, current vLLM)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# -- the array form: the same events, tagged by name as an array's first item ----------------
class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _ArrayKVEventBatch(EventBatch):
    events: list[_ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared]


def _from_array(batch: _ArrayKVEventBatch) -> KVEventBatch:
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for e in batch.events:
        if isinstance(e, _ArrayBlockStored):
            events.append(BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids,
                                      e.block_size, e.lora_id, e.medium, e.lora_name,
                                      e.extra_keys))
        elif isinstance(e, _ArrayBlockRemoved):
            events.append(BlockRemoved(e.block_hashes, e.medium))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(batch.ts, events, batch.data_parallel_rank)


class BatchDecoder:
    """Decodes payloads of either wire form, trying first the form that last worked."""

    def __init__(self) -> None:
        self._map = msgspec.msgpack.Decoder(KVEventBatch)
        self._array = msgspec.msgpack.Decoder(_ArrayKVEventBatch)
        self._array_first = False

    def decode(self, payload: bytes) -> KVEventBatch:
        first, second = (self._array, self._map) if self._array_first else (self._map, self._array)
        try:
            batch = first.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            try:
                batch = second.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                raise BadEventBatch(f"not a KV event batch: {exc}") from None
            self._array_first = not self._array_first
        return _from_array(batch) if isinstance(batch, _ArrayKVEventBatch) else batch


def encode_batch(batch: KVEventBatch, encoder: msgspec.msgpack.Encoder | None = None) -> bytes:
    """The payload vLLM's ZmqEventPublisher sends for `batch`."""
    return (encoder or _ENCODER).encode(batch)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    if len(frame) != 8:
        raise BadEventBatch(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


_ENCODER = msgspec.msgpack.Encoder()
