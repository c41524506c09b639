"""The KV cache manager of a model with several KV cache groups (kv_cache_groups.py), after
vLLM's hybrid allocator (its KVCacheCoordinator over a FullAttentionManager and a
SlidingWindowManager): every group has a block table of its own per sequence, all of the same
length (block i of each holds positions i*B..i*B+B-1 of that group's layers).

- Freeing: before a sequence's blocks grow, a sliding-window group gives back the blocks that lie
  wholly before the window of its next token (they can never be read again) and NULL_BLOCK takes
  their place; their hash stays cached until the pool reuses them. Full-attention groups keep
  every block, so a sequence holds about `window` tokens per sliding group.
- Prefix hits: a full-attention group needs every block up to the hit, a sliding-window group
  only the blocks inside the window of the first token it computes (vLLM's
  find_longest_cache_hit); the hit is the longest length every group accepts.
- Every group's block of a position carries the same canonical hash (routing/hashing.py); the
  pool publishes events for group 0 only (block_pool.py).
"""

from __future__ import annotations

from backend_engine.block_pool import BlockPool
from backend_engine.config import EngineConfig
from backend_engine.kv_block import NULL_BLOCK, KVBlock
from backend_engine.kv_cache_groups import KVCacheGroupSpec, blocks_for_tokens
from backend_engine.kv_cache_manager import KVCacheManager, cdiv
from backend_engine.sequence import Sequence

GroupBlocks = list[list[KVBlock]]  # one list per group


class HybridKVCacheManager(KVCacheManager):
    def __init__(self, pool: BlockPool, block_size: int, groups: list[KVCacheGroupSpec],
                 max_step_tokens: int):
        super().__init__(pool, block_size)
        self.groups = groups
        self.max_step_tokens = max_step_tokens  # the most tokens one step computes for a sequence

    def _tables(self, seq: Sequence) -> list[tuple[list[KVBlock], list[int]]]:
        for _ in range(len(self.groups) - 1 - len(seq.group_block_tables)):
            seq.group_block_tables.append([])
            seq.group_block_ids.append([])
        return [(seq.block_table, seq.block_ids),
                *zip(seq.group_block_tables, seq.group_block_ids)]

    # -- sizes -------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for_tokens(self.groups, num_tokens, self.block_size, self.max_step_tokens)

    def tokens_in(self, num_blocks: int) -> int:
        lo, hi = 0, num_blocks * self.block_size  # every group takes a block per block of tokens
        while lo < hi:  # at least one full-attention group makes the need grow with the tokens
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.blocks_for(mid) <= num_blocks else (lo, mid - 1)
        return lo

    # -- prefix cache ------------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> tuple[GroupBlocks, int]:
        """Each group's blocks of the longest prefix every group can serve (one token short)."""
        if not self.enable_caching:
            return [[] for _ in self.groups], 0
        hashes = seq.block_hashes[:self._hash_upto(seq, seq.num_tokens - 1)]
        hit = len(hashes)
        while True:  # a shorter hit may drop another sliding group's window: until all agree
            agreed = min(self._cache_hit(g, spec, hashes, hit)
                         for g, spec in enumerate(self.groups))
            if agreed == hit:
                break
            hit = agreed
        blocks = []
        for g, spec in enumerate(self.groups):
            start = max(0, hit - self._window_blocks(spec)) if spec.is_sliding else 0
            blocks.append([NULL_BLOCK] * start
                          + [self.pool.lookup(h, g) for h in hashes[start:hit]])
        return blocks, hit * self.block_size

    def _window_blocks(self, spec: KVCacheGroupSpec) -> int:
        """Blocks before a block boundary that the window of the token after it reads."""
        return cdiv(spec.sliding_window - 1, self.block_size)

    def _cache_hit(self, group: int, spec: KVCacheGroupSpec, hashes: list[int],
                   limit: int) -> int:
        """The most of hashes[:limit] (in blocks) this group can serve."""
        cached = [self.pool.lookup(h, group) is not None for h in hashes[:limit]]
        if not spec.is_sliding:
            return cached.index(False) if False in cached else limit
        need, run = self._window_blocks(spec), 0
        if need == 0:
            return limit
        for i in range(limit - 1, -1, -1):  # the latest run of `need` cached blocks
            run = run + 1 if cached[i] else 0
            if run == need:
                return i + need
        return run  # a shorter run from the first block serves as well

    def fork_blocks(self, parent: Sequence, child: Sequence) -> tuple[GroupBlocks, int]:
        """The parent's prompt blocks, while every sliding group still holds their window."""
        num_full = min(parent.num_computed_tokens, child.num_tokens - 1) // self.block_size
        blocks = [table[:num_full] for table, _ in self._tables(parent)]
        for spec, table in zip(self.groups, blocks):
            start = max(0, num_full - self._window_blocks(spec))
            if spec.is_sliding and any(b is NULL_BLOCK for b in table[start:]):
                return [[] for _ in self.groups], 0  # the parent has moved past them
        return blocks, num_full * self.block_size

    # -- allocation --------------------------------------------------------------------------
    def enable_partial_reuse(self, copy_blocks) -> None:  # noqa: ANN001
        """Not with several groups: whole blocks only (partial_block.py copies one table's)."""

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int,
                          computed_blocks: GroupBlocks = (), partial: None = None) -> int:
        computed = computed_blocks or [[] for _ in self.groups]
        total = cdiv(seq.num_computed_tokens + len(computed[0]) * self.block_size
                     + num_new_tokens, self.block_size)
        new = sum(max(0, total - len(table) - len(blocks))
                  for (table, _), blocks in zip(self._tables(seq), computed))
        revived = sum(1 for blocks in computed for b in blocks
                      if b.ref_cnt == 0 and b is not NULL_BLOCK)  # leave the free queue
        return new + revived

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: GroupBlocks = (), partial: None = None) -> bool:
        """As KVCacheManager's, in every group; sliding groups first give back the blocks no
        step can read again (given back even when the allocation then falls short)."""
        self._remove_skipped_blocks(seq)
        if not self.can_allocate(seq, num_new_tokens, computed_blocks):
            return False
        tables = self._tables(seq)
        if any(computed_blocks):
            self.pool.touch([b for blocks in computed_blocks for b in blocks
                             if b is not NULL_BLOCK])
            for (table, ids), blocks in zip(tables, computed_blocks):
                self._extend(table, ids, blocks)
            seq.num_computed_tokens += len(computed_blocks[0]) * self.block_size
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        for table, ids in tables:
            if total > len(table):
                self._extend(table, ids, self.pool.allocate(total - len(table)))
        return True

    def _remove_skipped_blocks(self, seq: Sequence) -> None:
        """Give back sliding groups' blocks wholly before the window of the next token."""
        for spec, (table, ids) in zip(self.groups, self._tables(seq)):
            if not spec.is_sliding:
                continue
            skipped = max(0, seq.num_computed_tokens - spec.sliding_window + 1) // self.block_size
            freed = []
            for i in range(min(skipped, len(table)) - 1, -1, -1):  # new ones only: O(freed)
                if table[i] is NULL_BLOCK:
                    break
                freed.append(table[i])
                table[i], ids[i] = NULL_BLOCK, NULL_BLOCK.block_id
            self.pool.release(freed[::-1])  # the oldest first: evicted first

    def reclaimable(self, victims: list[Sequence], computed_blocks: GroupBlocks = ()) -> int:
        return super().reclaimable(victims, [b for blocks in computed_blocks for b in blocks])


def kv_cache_manager(pool: BlockPool, groups: list[KVCacheGroupSpec],
                     config: EngineConfig) -> KVCacheManager:
    """The manager for the runner's groups: today's one-group manager, or the hybrid one (a
    sequence computes at most max_num_batched_tokens tokens a step)."""
    if len(groups) == 1:
        return KVCacheManager(pool, config.block_size)
    return HybridKVCacheManager(pool, config.block_size, groups, config.max_num_batched_tokens)
