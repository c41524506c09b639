"""Draft-model proposer: a smaller model sharing the target's tokenizer drafts k tokens per
sequence, batched, with its own paged KV cache under the same block-pool rules (reference
counts, LRU, prefix caching of verified tokens only). Each sequence has a shadow in the draft
cache; after verification the shadow keeps the KV of tokens the target accepted and drops the
rest."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from transformers import AutoConfig

from backend_engine.argmax import argmax_rows
from backend_engine.block_pool import BlockPool
from backend_engine.config import EngineConfig
from backend_engine.errors import ModelLoadError
from backend_engine.kv_cache_manager import KVCacheManager
from backend_engine.model_families import check_config
from backend_engine.model_loader import resolve_model
from backend_engine.model_runner import ModelRunner
from backend_engine.sampler import SamplingRow
from backend_engine.sequence import Sequence


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target_vocab_size: int, max_model_len: int):
        files = resolve_model(config.draft_model)
        hf_config = AutoConfig.from_pretrained(files.folder)
        check_config(hf_config)
        if hf_config.vocab_size != target_vocab_size:
            raise ModelLoadError(
                f"draft model vocabulary ({hf_config.vocab_size}) differs from the target's "
                f"({target_vocab_size}); the draft must share the target's tokenizer")
        # int8/int4 quantise the draft too; awq/gptq name the target checkpoint's format
        quantization = config.quantization if config.quantization in ("int8", "int4") else None
        draft_config = dataclasses.replace(config, model=config.draft_model,  # rank 0 only
                                           speculative_method=None, tensor_parallel_size=1,
                                           quantization=quantization,
                                           # its shadows roll back: every layer keeps its blocks
                                           disable_hybrid_kv_cache_manager=True)
        self.runner = ModelRunner(draft_config, files.folder, hf_config, max_model_len)
        self.pool = BlockPool(self.runner.num_blocks, enable_caching=config.enable_prefix_caching,
                              event_buffer=1)
        self.kv = KVCacheManager(self.pool, config.block_size)
        self.k = config.num_speculative_tokens
        self.shadows: dict[str, Sequence] = {}
        self._verified: dict[str, int] = {}  # tokens known verified at the last sync

    def propose_batch(self, work: list[tuple[Sequence, int]],
                      rows_for: Callable[[Sequence, list[int]], SamplingRow]) -> None:
        """Set spec_token_ids (and spec_draft_probs when sampling) on each sequence.
        work: (sequence, most tokens it may draft); rows_for(seq, drafts so far) → SamplingRow."""
        active = []
        for seq, room in work:
            shadow = self._sync(seq)
            if shadow is not None:
                active.append([seq, shadow, min(room, self.k), [], []])
        for step in range(self.k):
            batch = [a for a in active if len(a[3]) < a[2]]
            scheduled = []
            for item in batch:
                shadow = item[1]
                n = shadow.num_tokens - shadow.num_computed_tokens
                if self.kv.allocate_slots(shadow, n):
                    scheduled.append((shadow, n))
                else:  # the draft cache is full: this sequence drafts no further
                    item[2] = len(item[3])
            if not scheduled:
                break
            inputs, logits = self.runner.forward(scheduled)
            for shadow, n in scheduled:
                shadow.num_computed_tokens += n
            by_shadow = {id(sh): row for sh, row, _ in inputs.sampled_seqs}
            for seq, shadow, limit, drafts, probs in batch:
                if id(shadow) not in by_shadow or len(drafts) >= limit:
                    continue
                row = rows_for(seq, drafts)
                token, q = self._sample(logits[by_shadow[id(shadow)]:by_shadow[id(shadow)] + 1],
                                        row, seq)
                drafts.append(token)
                probs.append(q)
                shadow.append_token(token)
        for seq, shadow, _, drafts, probs in active:
            seq.spec_token_ids = drafts
            seq.spec_draft_probs = None if seq.params.greedy or not drafts else torch.cat(probs)

    def _sample(self, logits: torch.Tensor, row: SamplingRow, seq: Sequence):
        sampler = self.runner.sampler
        logits = sampler.process(logits, [row])
        if seq.params.greedy:
            return int(argmax_rows(logits)[0]), None
        q = sampler.probs(logits, [row]).cpu()  # drawn by the request's (CPU) generator
        generator = seq.generator or sampler.generator
        return int(torch.multinomial(q[0], 1, generator=generator)), q

    def _sync(self, seq: Sequence) -> Sequence | None:
        """The sequence's shadow, holding KV only for tokens the target has verified."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Sequence(seq.seq_id, seq.request_id, seq.index, seq.prompt_token_ids,
                              seq.params, seq.namespace, seq.max_tokens)
            blocks, hit = self.kv.get_computed_blocks(seq)
            if not self.kv.allocate_slots(shadow, 0, blocks):
                return None
            self.shadows[seq.seq_id] = shadow
        start = self._verified.get(seq.seq_id, 0)
        common = start + _common_prefix(shadow.token_ids[start:], seq.token_ids[start:])
        shadow.token_ids = list(seq.token_ids)
        self._verified[seq.seq_id] = seq.num_tokens
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common,
                                         seq.num_tokens - 1)
        shadow.block_hashes = shadow.block_hashes[:common // self.kv.block_size]
        self.kv.trim_to(shadow, shadow.num_computed_tokens)
        self.kv.cache_computed_blocks(shadow)
        return shadow

    def release(self, seq_id: str) -> None:
        shadow = self.shadows.pop(seq_id, None)
        self._verified.pop(seq_id, None)
        if shadow is not None:
            self.kv.free(shadow)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
