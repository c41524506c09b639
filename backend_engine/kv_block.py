"""One KV cache block's bookkeeping record, shared by the block pool, its free queue and the
sequences whose block tables hold it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    hits: int = 0  # prefix-cache hits since the hash was stored
    pin_cnt: int = 0  # pins holding this block (each also holds one reference)
