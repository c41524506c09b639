"""Map a foreign engine's blocks (vLLM, SGLang, a kvgate replica's ZMQ stream) onto canonical
block hashes, so they land in the same prefix index as a kvgate replica's events.

An engine's block hashes are its own (sha256 or builtin, seeded, with extra keys), so they are
never trusted or recomputed: each stored block is re-hashed with `routing.hashing` from its
token ids, chained on its parent's mapping. What is kept per engine block is where the canonical
chain stands after it: the canonical hash of the last full canonical block (`tail`), the tokens
after that block (`pending`, non-empty only when the engine's block size differs from ours) and
the canonical blocks this engine block completed (`completed`, what its removal takes away).
Any engine block size maps this way (SGLang's page size 1, vLLM's 16, 32 or 64).

Rules: a block whose parent was never seen (joined late, events lost) is dropped, never guessed;
a block whose hash depends on something other than tokens (images, prompt embeddings) is
dropped, and so are its children; a canonical hash completed by several engine blocks (two DP
ranks, GPU and CPU copies, a block re-stored after a radix split) stays until the last goes.
Blocks of a KV tier's medium (`TIER_MEDIA`: kvgate's `CPU_TIER`, `DISK`) are counted apart, so
the index can price them as a restore rather than a hit; vLLM's `CPU` counts as cached, as it
names a CPU engine's pool as well as a GPU engine's offload tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from protocol.kv_events import (MEDIUM_CPU, MEDIUM_GPU, TIER_MEDIA, AllBlocksCleared,
                                BlockRemoved, BlockStored, ExternalBlockHash, KVEventBatch)
from routing.hashing import block_hash, block_hashes, namespace_for, root_hash

_Nets = tuple[dict[int, bool], dict[int, bool]]  # pool, tier: canonical hash -> still held
# Attention kinds whose blocks are a reusable prefix; other groups (sliding window, mamba) of a
# hybrid model repeat the full-attention group's tokens and are skipped.
FULL_ATTENTION_KINDS = (None, "full_attention", "FullAttentionSpec")
# A block's record is its canonical hash in the common case (nothing pending, it completed exactly
# that block), else the tuple (tail, pending tokens, completed hashes).


@dataclass(slots=True)
class MapStats:
    stored_blocks: int = 0  # engine blocks mapped
    removed_blocks: int = 0  # engine blocks removed
    unknown_parent: int = 0  # dropped: parent never seen
    unmappable: int = 0  # dropped: hash depends on more than tokens, or tokens do not fit
    ignored: int = 0  # blocks of non-full-attention groups
    unknown_removed: int = 0  # removals of blocks never mapped (normal after a late join)
    evicted: int = 0  # mappings dropped to stay under max_blocks


@dataclass(slots=True)
class BlockChanges:
    """Canonical hashes to add to and drop from the replica's index, final state per hash."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    tier_stored: list[int] = field(default_factory=list)  # in a KV tier below the pool
    tier_removed: list[int] = field(default_factory=list)


class EngineBlockMap:
    """One foreign replica: every DP rank's engine blocks and the canonical hashes they make."""

    def __init__(self, model: str, block_size: int, max_blocks: int = 4_000_000) -> None:
        if block_size <= 0 or max_blocks <= 0:
            raise ValueError("block_size and max_blocks must be positive")
        self.model = model
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.stats = MapStats()
        self._ranks: dict[int, dict[object, object]] = {}
        self._refs: dict[int, int] = {}  # canonical hash -> engine blocks that completed it
        self._tier_refs: dict[int, int] = {}  # the same for blocks of a tier medium
        self._num_blocks = 0

    def __len__(self) -> int:
        return self._num_blocks

    @property
    def canonical(self) -> set[int]:
        return set(self._refs)

    @property
    def tier_canonical(self) -> set[int]:
        return set(self._tier_refs)

    # -- events ---------------------------------------------------------------------------
    def apply(self, batch: KVEventBatch, rank: int = 0) -> BlockChanges:
        nets: _Nets = ({}, {})  # pool, tier: canonical hash -> held after this batch
        blocks = self._ranks.setdefault(rank, {})
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(blocks, event, nets[event.medium in TIER_MEDIA])
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._remove(blocks, _key(h, event.medium, event.group_idx), nets)
            elif isinstance(event, AllBlocksCleared):
                self._clear_rank(rank, nets)
                blocks = self._ranks.setdefault(rank, {})
        if self._num_blocks > self.max_blocks:
            self._evict(nets)
        return _changes(nets)

    def clear_rank(self, rank: int) -> BlockChanges:
        """Forget one rank's blocks (its publisher restarted, or events were lost)."""
        nets: _Nets = ({}, {})
        self._clear_rank(rank, nets)
        return _changes(nets)

    def clear(self) -> BlockChanges:
        nets: _Nets = ({}, {})
        for rank in list(self._ranks):
            self._clear_rank(rank, nets)
        return _changes(nets)

    # -- internals ------------------------------------------------------------------------
    def _stored(self, blocks: dict, event: BlockStored, net: dict[int, bool]) -> None:
        n = len(event.block_hashes)
        if event.kv_cache_spec_kind not in FULL_ATTENTION_KINDS:
            self.stats.ignored += n
            return
        tokens = event.token_ids
        if n == 0:
            return
        if n > 1 and len(tokens) != n * event.block_size:
            self.stats.unmappable += n  # null or masked blocks inside the run: cannot align
            return
        per_block = len(tokens) // n
        medium, group = event.medium, event.group_idx
        parent = event.parent_block_hash
        if parent is None:
            state = self._root(event)
            if state is None:
                self.stats.unmappable += n
                return
        else:
            state = blocks.get(_key(parent, medium, group))
            for other, g in ((None, None), (MEDIUM_CPU, group), *((m, group) for m in TIER_MEDIA)):
                if state is None and (other, g) != (medium, group):  # a parent on another medium
                    state = blocks.get(_key(parent, other, g))
            if state is None:
                self.stats.unknown_parent += n
                return
        extra = event.extra_keys
        if extra is None and per_block == self.block_size:
            tail = state if isinstance(state, int) else (None if state[1] else state[0])
            if tail is not None:  # the common case: one hashing pass over the whole run
                self._stored_aligned(blocks, event, tail, net)
                return
        start = 0
        for i, engine_hash in enumerate(event.block_hashes):
            keys = extra[i] if extra is not None and i < len(extra) else None
            if keys and not _only_names(keys, event.lora_name, parent is None and i == 0):
                self.stats.unmappable += n - i  # images or embeddings: tokens are not enough
                return
            key = _key(engine_hash, medium, group)
            end = start + per_block if i < n - 1 else len(tokens)
            state = self._chain(state, tokens, start, end)
            start = end
            if key in blocks:
                continue  # re-reported (a reused prefix, a radix split): nothing new
            blocks[key] = state
            self._num_blocks += 1
            self.stats.stored_blocks += 1
            refs = self._tier_refs if medium in TIER_MEDIA else self._refs
            for h in _completed(state):
                c = refs.get(h, 0)
                refs[h] = c + 1
                if c == 0:
                    net[h] = True

    def _stored_aligned(self, blocks: dict, event: BlockStored, tail: int,
                        net: dict[int, bool]) -> None:
        medium, group = event.medium, event.group_idx
        plain = (medium is None or medium == MEDIUM_GPU) and not group
        refs = self._tier_refs if medium in TIER_MEDIA else self._refs
        added = 0
        for engine_hash, h in zip(event.block_hashes,
                                  block_hashes(event.token_ids, "", self.block_size, parent=tail)):
            key = engine_hash if plain else (medium, group or 0, engine_hash)
            if key in blocks:
                continue
            blocks[key] = h
            added += 1
            c = refs.get(h, 0)
            refs[h] = c + 1
            if c == 0:
                net[h] = True
        self._num_blocks += added
        self.stats.stored_blocks += added

    def _root(self, event: BlockStored) -> object | None:
        """The chain state before a root block: the namespace's root hash."""
        salt = None
        keys = event.extra_keys[0] if event.extra_keys else None
        for k in keys or ():
            if isinstance(k, str) and k != event.lora_name:
                salt = k
        model = event.lora_name or self.model
        return (root_hash(namespace_for(model, salt)), (), ())

    def _chain(self, state: object, tokens: Sequence[int], start: int, end: int) -> object:
        bs = self.block_size
        if isinstance(state, int):
            tail, pending = state, ()
        else:
            tail, pending, _ = state
        if not pending and end - start == bs:
            return block_hash(tail, tokens[start:end])
        run = list(pending) + list(tokens[start:end])
        full = len(run) // bs * bs
        completed = tuple(block_hashes(run[:full], "", bs, parent=tail)) if full else ()
        if completed:
            tail = completed[-1]
        rest = tuple(run[full:])
        if not rest and len(completed) == 1:
            return tail
        return (tail, rest, completed)

    def _remove(self, blocks: dict, key: object, nets: _Nets) -> None:
        state = blocks.pop(key, None)
        if state is None:
            self.stats.unknown_removed += 1
            return
        self._num_blocks -= 1
        self.stats.removed_blocks += 1
        self._release(key, state, nets)

    def _release(self, key: object, state: object, nets: _Nets) -> None:
        tier = isinstance(key, tuple) and key[0] in TIER_MEDIA
        refs, net = (self._tier_refs, nets[1]) if tier else (self._refs, nets[0])
        for h in _completed(state):
            c = refs.get(h, 0) - 1
            if c > 0:
                refs[h] = c
            else:
                refs.pop(h, None)
                net[h] = False

    def _clear_rank(self, rank: int, nets: _Nets) -> None:
        blocks = self._ranks.pop(rank, None) or {}
        self._num_blocks -= len(blocks)
        for key, state in blocks.items():
            self._release(key, state, nets)

    def _evict(self, nets: _Nets) -> None:
        # Oldest mappings first (dicts keep insertion order), from the largest rank.
        while self._num_blocks > self.max_blocks:
            blocks = max(self._ranks.values(), key=len)
            key = next(iter(blocks))
            self._release(key, blocks.pop(key), nets)
            self._num_blocks -= 1
            self.stats.evicted += 1


def _key(engine_hash: ExternalBlockHash, medium: str | None, group: int | None) -> object:
    if (medium is None or medium == MEDIUM_GPU) and not group:
        return engine_hash
    return (medium, group or 0, engine_hash)


def _completed(state: object) -> tuple[int, ...]:
    return (state,) if isinstance(state, int) else state[2]


def _only_names(keys: Sequence[object], lora_name: str | None, root: bool) -> bool:
    """Whether a block's extra keys are only its LoRA name and (on the root block) a cache salt:
    the only extras the canonical namespace can express."""
    for k in keys:
        if not isinstance(k, str):
            return False  # (mm identifier, offset) pairs, prompt-embedding digests
        if k != lora_name and not root:
            return False
    return True


def _changes(nets: _Nets) -> BlockChanges:
    out = BlockChanges()
    for h, stored in nets[0].items():
        (out.stored if stored else out.removed).append(h)
    for h, stored in nets[1].items():
        (out.tier_stored if stored else out.tier_removed).append(h)
    return out
