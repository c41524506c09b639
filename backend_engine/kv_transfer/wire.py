"""The messages of one transfer, as msgpack headers (msgspec) followed by one raw frame per
block. Sender → receiver: begin, data, end, abort, ping. Receiver → sender: accept, ack, done,
error.

    begin(id, layout, hashes, hint)  → accept(id, need, window) | error(id, reason)
    data(id, seq, [(index, checksum)…]) + frames  → ack(id, seq)      (at most `window` unacked)
    end(id, count)                   → done(id, imported)
    abort(id, reason)                  the sender gave up; the receiver frees what it reserved
    ping(ids)                          the sender is alive (its prefill is still computing)

Every block frame carries K then V of every layer for one block ([layers, 2, block_size,
kv_heads, head_dim] in the layout's dtype) and is checked against its xxh3-64 checksum."""

from __future__ import annotations

import msgspec
import xxhash


class KVLayout(msgspec.Struct, frozen=True):
    """What must match between sender and receiver for blocks to be interchangeable."""

    model: str  # the model id the block hashes' namespace is built from
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    @property
    def block_bytes(self) -> int:
        width = 4 if self.dtype == "float32" else 2
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * width


class Begin(msgspec.Struct, tag="begin"):
    id: str
    layout: KVLayout
    hashes: list[int]
    hint: int = 0


class Accept(msgspec.Struct, tag="accept"):
    id: str
    need: list[int]
    window: int


class Data(msgspec.Struct, tag="data"):
    id: str
    seq: int
    blocks: list[tuple[int, int]]  # (block index, checksum), one per frame that follows


class Ack(msgspec.Struct, tag="ack"):
    id: str
    seq: int


class End(msgspec.Struct, tag="end"):
    id: str
    count: int  # blocks sent in all


class Done(msgspec.Struct, tag="done"):
    id: str
    received: int  # blocks received and verified


class Abort(msgspec.Struct, tag="abort"):
    id: str
    reason: str


class Error(msgspec.Struct, tag="error"):
    id: str
    reason: str
    code: str = "peer_error"


class Ping(msgspec.Struct, tag="ping"):
    ids: list[str]


Message = Begin | Accept | Data | Ack | End | Done | Abort | Error | Ping

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(header: bytes | memoryview) -> Message:
    """Raises msgspec.DecodeError (a ValueError) on anything that is not one of ours."""
    return _decoder.decode(header)


def checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)
