"""Per-sequence KV block management over the block pool: prefix-cache lookup (whole blocks,
then part of the next one: partial_block.py), slot allocation, caching of full verified blocks,
forking for n > 1, and freeing. One KV cache group (every layer in every block);
hybrid_kv_cache_manager.py adds the groups of sliding-window models, so the methods that hold
for any number of groups walk `_tables(seq)`."""

from __future__ import annotations

from collections.abc import Callable

from backend_engine.block_pool import BlockOrigin, BlockPool
from backend_engine.kv_block import NULL_BLOCK, KVBlock
from backend_engine.partial_block import BlockChildren, PartialHit
from backend_engine.sequence import Sequence
from routing.hashing import block_hashes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found cached
        self.copy_blocks: Callable[[list[tuple[int, int]]], None] | None = None

    def enable_partial_reuse(self, copy_blocks: Callable[[list[tuple[int, int]]], None]) -> None:
        """Reuse cached tokens below block granularity; copy_blocks([(src, dst)]) copies whole
        blocks of K/V in the paged cache (the model runner's)."""
        if self.enable_caching:
            self.copy_blocks = copy_blocks
            self.pool.children = BlockChildren()

    @staticmethod
    def _tables(seq: Sequence) -> list[tuple[list[KVBlock], list[int]]]:
        """Each group's (block table, block ids) of the sequence."""
        return [(seq.block_table, seq.block_ids)]

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def _hash_upto(self, seq: Sequence, num_tokens: int) -> int:
        """Extend seq.block_hashes to cover the first num_tokens tokens (full blocks only);
        returns how many of them count (the list may hold more, from drafts rolled back)."""
        num_full = num_tokens // self.block_size
        have = len(seq.block_hashes)
        if have < num_full:
            parent = seq.block_hashes[-1] if have else None
            seq.block_hashes.extend(block_hashes(
                seq.token_ids[have * self.block_size: num_full * self.block_size],
                seq.namespace, self.block_size, parent=parent))
        return num_full

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVBlock], int]:
        """Longest cached prefix; it stops one token short so the last one yields logits."""
        if not self.enable_caching:
            return [], 0
        blocks: list[KVBlock] = []
        num_full = self._hash_upto(seq, seq.num_tokens - 1)
        for h in seq.block_hashes[:num_full]:
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        if self.pool.tier is not None and len(blocks) < num_full:
            blocks += self._restore(seq.block_hashes[len(blocks):num_full], blocks,
                                    first_lookup=seq.num_cached_tokens < 0)
        return blocks, len(blocks) * self.block_size

    def partial_hit(self, seq: Sequence, blocks: list[KVBlock]) -> PartialHit | None:
        """Past the whole cached blocks found for a fresh sequence: the cached block continuing
        the same prefix whose leading tokens the sequence shares the longest (never its last
        token, which must yield logits)."""
        if self.copy_blocks is None or not blocks or seq.block_table or seq.num_computed_tokens:
            return None
        start = len(blocks) * self.block_size
        limit = min(self.block_size - 1, seq.num_tokens - 1 - start)
        if limit <= 0:
            return None
        found = self.pool.children.longest(seq.block_hashes[len(blocks) - 1],
                                           seq.token_ids[start:start + limit])
        if found is None:
            return None
        block = self.pool.lookup(found[0])
        return None if block is None else PartialHit(block, found[1])

    def waiting_for_kv(self, seq: Sequence) -> bool:
        """Whether the sequence waits for its prefix's blocks to be read from the disk tier
        (starting the reads); it holds no pool block meanwhile."""
        tier = self.pool.tier
        if tier is None or tier.staging is None or not self.enable_caching:
            return False
        num_full = self._hash_upto(seq, seq.num_tokens - 1)
        hashes = seq.block_hashes[:num_full]
        i = 0
        while i < num_full and hashes[i] in self.pool.cached:
            i += 1
        return tier.wait_for_disk(seq.seq_id, hashes[i:])

    def _restore(self, hashes: list[int], held: list[KVBlock], first_lookup: bool) -> list[KVBlock]:
        """Copy the tier's blocks that continue a prefix into free pool blocks, cached (and
        free) as if never evicted; returns them in prefix order."""
        tier, pool = self.pool.tier, self.pool
        n = 0
        for h in hashes:  # stop where the pool holds the block already, or the tier cannot serve
            if h in pool.cached or not tier.servable(h):
                break
            n += 1
        got: list[KVBlock] = []
        if n:
            tier.touch(hashes[:n])  # the most recent: the eviction the allocation causes spares them
            pool.hold(held)  # the allocation below must not reuse the prefix found so far
            try:
                fresh = pool.allocate(min(n, pool.num_free_blocks))
                restored = tier.restore(hashes[:len(fresh)], [b.block_id for b in fresh])
                got = fresh[:restored]
                for block, h in zip(got, hashes):
                    pool.cache_block(block, h, tier.origins.get(h))
                pool.release(list(reversed(fresh)))
            finally:
                pool.release(list(reversed(held)))
        tier.stats.hits += len(got) * self.block_size
        if first_lookup:
            tier.stats.misses += (len(hashes) - len(got)) * self.block_size
        return got

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens

    def fork_blocks(self, parent: Sequence, child: Sequence) -> tuple[list[KVBlock], int]:
        """The parent's full prompt blocks, for a sibling that shares its prompt."""
        num_full = min(parent.num_computed_tokens, child.num_tokens - 1) // self.block_size
        blocks = parent.block_table[:num_full]
        return blocks, num_full * self.block_size

    def tokens_in(self, num_blocks: int) -> int:
        """The longest sequence num_blocks pool blocks hold."""
        return num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Pool blocks one sequence of num_tokens tokens holds at the most."""
        return cdiv(num_tokens, self.block_size)

    def reclaimable(self, victims: list[Sequence], computed_blocks=()) -> int:
        """Blocks that preempting the victims would free (not those computed_blocks share)."""
        computed = {id(b) for b in computed_blocks}  # they stay held by the new sequence
        return sum(1 for v in victims for table, _ in self._tables(v) for b in table
                   if b.ref_cnt == 1 and b is not NULL_BLOCK and id(b) not in computed)

    def can_allocate(self, seq: Sequence, num_new_tokens: int,
                     computed_blocks: list[KVBlock] = (), partial: PartialHit | None = None
                     ) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens, computed_blocks, partial) <= \
            self.pool.num_free_blocks

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int,
                          computed_blocks: list[KVBlock] = (), partial: PartialHit | None = None
                          ) -> int:
        """Free blocks allocate_slots would take (new ones and revived cached ones; a partial
        hit's source leaves the free queue while it is copied)."""
        have = len(seq.block_table) + len(computed_blocks)
        total_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size \
            + num_new_tokens + (partial.num_tokens if partial else 0)
        new = max(0, cdiv(total_tokens, self.block_size) - have)
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)  # leave the free queue
        if partial is not None and partial.block.ref_cnt == 0:
            revived += 1
        return new + revived

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[KVBlock] = (), partial: PartialHit | None = None
                       ) -> bool:
        """Reserve blocks for num_new_tokens more tokens (after the cached ones found, whole
        and partial); False (and no change) if short."""
        if not self.can_allocate(seq, num_new_tokens, computed_blocks, partial):
            return False
        if computed_blocks:
            self.pool.touch(list(computed_blocks))
            self._append(seq, computed_blocks)
            seq.num_computed_tokens += len(computed_blocks) * self.block_size
        if partial is None:
            self._allocate(seq, num_new_tokens)
            return True
        self.pool.hold([partial.block])  # allocating must not evict the copy's source
        try:
            first_new = len(seq.block_table)
            self._allocate(seq, partial.num_tokens + num_new_tokens)
            self.copy_blocks([(partial.block.block_id, seq.block_ids[first_new])])
            seq.num_computed_tokens += partial.num_tokens
        finally:
            self.pool.release([partial.block])
        return True

    def _allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        need = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) \
            - len(seq.block_table)
        if need > 0:
            self._append(seq, self.pool.allocate(need))
        if self.pool.tier is not None:  # what its disk read brought is in the pool now; kept
            self.pool.tier.release(seq.seq_id)  # until then, should evictions take it back

    def _append(self, seq: Sequence, blocks) -> None:
        self._extend(seq.block_table, seq.block_ids, blocks)

    @staticmethod
    def _extend(table: list[KVBlock], ids: list[int], blocks) -> None:
        table.extend(blocks)
        ids.extend(b.block_id for b in blocks)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publish blocks whose every token is computed and verified (never draft tokens)."""
        if not self.enable_caching:
            return
        verified = min(seq.num_computed_tokens, seq.num_tokens)
        num_full = min(self._hash_upto(seq, verified), len(seq.block_table))
        hashes, keep, bs = seq.block_hashes, self.pool.keep_origins, self.block_size
        keep = keep or self.copy_blocks is not None  # partial reuse indexes blocks by parent
        for group, (table, _) in enumerate(self._tables(seq)):
            for i in range(seq.num_hashed_blocks, num_full):  # blocks not seen before: O(new)
                block = table[i]
                if block.block_hash is None and block is not NULL_BLOCK:
                    origin = BlockOrigin(hashes[i - 1] if i else None,
                                         tuple(seq.token_ids[i * bs:(i + 1) * bs]),
                                         seq.namespace) if keep and not group else None
                    self.pool.cache_block(block, hashes[i], origin, group)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    def trim_to(self, seq: Sequence, num_tokens: int) -> None:
        """Drop blocks past num_tokens (rolling back unaccepted speculative slots)."""
        keep = cdiv(num_tokens, self.block_size)
        for table, ids in self._tables(seq):
            extra = table[keep:]
            if extra:
                del table[keep:]
                del ids[keep:]
                self._release(extra)
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, keep)

    def _release(self, blocks: list[KVBlock]) -> None:
        """Give back a table's blocks, tail first (the null placeholder is nobody's)."""
        self.pool.release([b for b in reversed(blocks) if b is not NULL_BLOCK])

    def free(self, seq: Sequence) -> None:
        if self.pool.tier is not None:
            self.pool.tier.release(seq.seq_id)  # an aborted wait for a disk read
        for table, _ in self._tables(seq):
            self._release(table)
        seq.block_table, seq.block_ids = [], []
        seq.group_block_tables, seq.group_block_ids = [], []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0
