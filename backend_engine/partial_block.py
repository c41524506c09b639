"""Prefix reuse below block granularity.

The prefix cache finds whole blocks by hash, so a prompt that shares 40 tokens with a cached one
reuses 32 (block size 16) and recomputes 8, and every shared run loses up to a block at its end.
SGLang's radix cache and llama.cpp's slots reuse any token prefix. Here the same is done on top
of the block pool: cached full blocks are indexed by their parent's hash, and where a request's
hashed prefix ends, the cached block continuing that same prefix whose leading tokens match the
request's next ones the longest has those tokens' K/V copied into the request's own new block
(copy-on-write: the cached block stays as it is). The block then fills and is hashed like any
other; KV events and the canonical block hash are unchanged.

A block is only a candidate under the same parent hash, and a parent hash carries the namespace
(model, tenant salt), so no tenant reuses another's tokens; a first block (no parent) is never
reused partly."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from backend_engine.kv_block import KVBlock


@dataclass(frozen=True, slots=True)
class PartialHit:
    block: KVBlock  # the cached block whose leading tokens the request shares
    num_tokens: int  # how many (1 .. block_size - 1)


class BlockChildren:
    """parent block hash → the cached blocks that follow it, with their tokens."""

    def __init__(self, max_scan: int = 256) -> None:
        self.max_scan = max_scan  # candidates compared per lookup, most recent first
        self._children: dict[int, dict[int, tuple[int, ...]]] = {}
        self._parent: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._parent)

    def add(self, parent: int, child: int, token_ids: tuple[int, ...]) -> None:
        self._children.setdefault(parent, {})[child] = token_ids
        self._parent[child] = parent

    def remove(self, child: int) -> None:
        parent = self._parent.pop(child, None)
        if parent is None:
            return
        siblings = self._children[parent]
        del siblings[child]
        if not siblings:
            del self._children[parent]

    def clear(self) -> None:
        self._children.clear()
        self._parent.clear()

    def longest(self, parent: int, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """(child hash, matched tokens) of the child sharing the longest leading run with
        `token_ids` (at least one token), or None."""
        siblings = self._children.get(parent)
        if not siblings or not token_ids:
            return None
        best, best_len = None, 0
        limit = len(token_ids)
        for scanned, child in enumerate(reversed(siblings)):  # the most recent first
            if scanned == self.max_scan:
                break
            tokens = siblings[child]
            n = 0
            while n < limit and tokens[n] == token_ids[n]:
                n += 1
            if n > best_len:
                best, best_len = child, n
                if n == limit:
                    break
        return None if best is None else (best, best_len)
