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
    group: int = 0  # the KV cache group whose hash it carries (kv_cache_groups.py)


# A table entry of a KV cache group that gave its block back (a sliding-window group's block
# before the window): the position keeps its index, the attention masks it and never reads its
# data, so its id is block 0, as the tables' padding. Never allocated, cached or released.
NULL_BLOCK = KVBlock(0)
