"""Per-sequence KV block management over the block pool: prefix-cache lookup, slot allocation,
caching of full verified blocks, forking for n > 1, and freeing. One KV cache group (every
layer in every block); hybrid_kv_cache_manager.py adds the groups of sliding-window models, so
the methods that hold for any number of groups walk `_tables(seq)`."""

from __future__ import annotations

from backend_engine.block_pool import BlockOrigin, BlockPool
from backend_engine.kv_block import NULL_BLOCK, KVBlock
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

    def _restore(self, hashes: list[int], held: list[KVBlock], first_lookup: bool) -> list[KVBlock]:
        """Copy the tier's blocks that continue a prefix into free pool blocks, cached (and
        free) as if never evicted; returns them in prefix order."""
        tier, pool = self.pool.tier, self.pool
        n = 0
        for h in hashes:  # stop where the pool holds the block already, or the tier does not
            if h in pool.cached or h not in tier:
                break
            n += 1
        got: list[KVBlock] = []
        if n:
            for h in hashes[:n]:  # the most recent: the eviction the allocation causes spares them
                tier.touch(h)
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
                     computed_blocks: list[KVBlock] = ()) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens, computed_blocks) <= \
            self.pool.num_free_blocks

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int,
                          computed_blocks: list[KVBlock] = ()) -> int:
        """Free blocks allocate_slots would take (new ones and revived cached ones)."""
        return self._num_blocks_needed(seq, num_new_tokens, computed_blocks)

    def _num_blocks_needed(self, seq, num_new_tokens, computed_blocks) -> int:
        have = len(seq.block_table) + len(computed_blocks)
        total_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size \
            + num_new_tokens
        new = max(0, cdiv(total_tokens, self.block_size) - have)
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)  # leave the free queue
        return new + revived

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[KVBlock] = ()) -> bool:
        """Reserve blocks for num_new_tokens more tokens; False (and no change) if short."""
        if not self.can_allocate(seq, num_new_tokens, computed_blocks):
            return False
        if computed_blocks:
            self.pool.touch(list(computed_blocks))
            self._append(seq, computed_blocks)
            seq.num_computed_tokens += len(computed_blocks) * self.block_size
        need = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) \
            - len(seq.block_table)
        if need > 0:
            self._append(seq, self.pool.allocate(need))
        return True

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
        for table, _ in self._tables(seq):
            self._release(table)
        seq.block_table, seq.block_ids = [], []
        seq.group_block_tables, seq.group_block_ids = [], []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0
