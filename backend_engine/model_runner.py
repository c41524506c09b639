"""The model runner: owns the weights and the paged KV cache, turns a scheduled batch into
input tensors and attention metadata, runs the forward pass and samples. No policy here.
Under tensor parallelism every rank runs one, on its shard, from the same StepBatch."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backend_engine.accel.attention import get_attention_backend
from backend_engine.accel.forward import PlannedForward
from backend_engine.accel.plan import Plan, plan_for
from backend_engine.accel.prepare import WeightPrep
from backend_engine.attention.metadata import (AttentionMetadata, PrefillChunk,
                                               build_kernel_metadata, grouped)
from backend_engine.config import EngineConfig
from backend_engine.distributed.group import SINGLE, TensorParallelGroup
from backend_engine.distributed.sharding import shard_layout, shard_state_dict
from backend_engine.dtype import resolve_dtype
from backend_engine.kv_cache_groups import engine_kv_cache_groups, layer_pages, page_layers
from backend_engine.kv_sizing import KVPoolSize, kv_block_bytes, kv_pool_size
from backend_engine.model_families import model_class
from backend_engine.quant.loader import load_weights, resolve_quantization
from backend_engine.rejection_sampler import verify_greedy, verify_sampled
from backend_engine.sampler import Sampler, SamplerOutput, SamplingRow
from backend_engine.sequence import Sequence
from backend_engine.step_batch import StepBatch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger("kvgate.engine")


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_index: list[int]  # flat indexes of the tokens whose logits are needed
    sampled: list[tuple[int, int, int]]  # (index in the batch, first row, number of rows)
    sampled_seqs: list[tuple[Sequence, int, int]] = field(default_factory=list)  # with sequences


@dataclass(slots=True)
class SeqResult:
    """What one step produced for a sequence: sampled (or verified) tokens and logprobs."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, folder: Path, hf_config, max_model_len: int,
                 tp: TensorParallelGroup = SINGLE):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        baseline = self._memory_baseline(config)
        self.dtype = DTYPES[resolve_dtype(config.dtype, config.device)]
        self.block_size = config.block_size
        plan = plan_for(config.device, config.engine_options, one_rank=tp.size == 1,
                        enforce_eager=config.enforce_eager)
        self.attention = get_attention_backend(plan.attention, config.device)
        quantization = resolve_quantization(config.quantization, hf_config, folder)
        model_cls = model_class(hf_config)
        weights = shard_state_dict(
            model_cls.checkpoint_weights(load_weights(folder, hf_config, quantization), hf_config),
            shard_layout(hf_config, tp.rank, tp.size))
        prep = WeightPrep(self.device, self.dtype, quantization,
                          config.quantization_group_size, plan.lm_head,
                          stack_experts=plan.experts == "triton")
        self.model = model_cls(hf_config, weights, self.attention, max_model_len, prep, tp=tp)
        self.sampler = Sampler(config.seed)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_cache_groups, masked_only = engine_kv_cache_groups(self.model.layer_windows(),
                                                                   config)
        if masked_only and tp.rank == 0:
            log.info("sliding-window layers keep every KV block (masked): %s", masked_only)
        self.layer_groups = layer_pages(self.kv_cache_groups, self.model.num_layers)[0]
        self.kv_pool = self._size_kv_pool(config, plan, baseline, max_model_len)
        self.allocate_kv(self.kv_pool.num_blocks)
        self.forward_pass = PlannedForward(self.model, plan, self.kv_caches, self.layer_groups)
        if tp.rank == 0:
            log.info("%s", self.forward_pass.describe())
            log.info("%s", self.kv_pool.describe(self.block_size, config.max_num_seqs,
                                                 config.max_num_batched_tokens))

    def check_health(self) -> None:
        """One process: nothing to watch (a tensor-parallel executor raises for a dead rank)."""

    def shutdown(self) -> None:
        """One process: nothing to stop."""

    def open_kv_tier(self, model_id: str, config: EngineConfig):  # -> KVTier
        """The KV tier below the pool (kv_offload_*), over this runner's KV cache."""
        from backend_engine.kv_tier.peers import open_tier

        return open_tier(self.kv_caches, model_id, config)

    def _memory_baseline(self, config: EngineConfig):  # -> CudaSnapshot | None
        """The device before the weights load, when the KV pool is sized from its memory."""
        if self.device.type != "cuda" or config.num_kv_blocks or config.kv_cache_memory_gb:
            return None
        from backend_engine.memory_profile import CudaSnapshot

        return CudaSnapshot.take(self.device)

    def _size_kv_pool(self, config: EngineConfig, plan: Plan, baseline,
                      max_model_len: int) -> KVPoolSize:
        m = self.model
        block_bytes = kv_block_bytes(page_layers(self.kv_cache_groups), self.block_size,
                                     m.num_kv_heads, m.head_dim, torch.finfo(self.dtype).bits // 8)
        profile = None
        if baseline is not None:
            from backend_engine.memory_profile import profile_cuda_memory

            self.forward_pass = PlannedForward(self.model, plan, self.kv_caches)  # eager on CUDA
            profile = profile_cuda_memory(self, baseline, config.max_num_batched_tokens,
                                          config.max_num_seqs, max_model_len)
        return kv_pool_size(block_bytes, num_kv_blocks=config.num_kv_blocks,
                            kv_cache_memory_gb=config.kv_cache_memory_gb,
                            gpu_memory_utilization=config.gpu_memory_utilization,
                            profile=profile)

    def allocate_kv(self, num_blocks: int) -> None:
        """(Re)allocate the paged KV cache (the old tensors go before the new ones are made)."""
        self.kv_caches.clear()
        self.num_blocks = num_blocks
        shape = (num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        pages = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                  torch.zeros(shape, dtype=self.dtype, device=self.device))
                 for _ in range(page_layers(self.kv_cache_groups))]
        _, tensor_of = layer_pages(self.kv_cache_groups, self.model.num_layers)
        self.kv_caches.extend(pages[tensor_of[layer]] for layer in range(self.model.num_layers))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks of every layer's K and V: (source block id, destination id)."""
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        for key, value in self.kv_caches:
            key.index_copy_(0, dst, key.index_select(0, src))
            value.index_copy_(0, dst, value.index_select(0, src))

    # -- batch preparation -----------------------------------------------------------------
    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        """Cache slots of positions [start, end): the new tokens of this step only."""
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, batch: StepBatch) -> StepInputs:
        """Inputs of one step. Python work is O(new tokens + blocks), never O(context)."""
        prompt_lens = batch.num_prompt_tokens
        # prompt tokens but the last are "prompt rows" (PrefillChunk.prompt_rows), a lone one
        # too (a chunk boundary); the last, alone, is computed as a decode row
        decodes = [i for i, tokens in enumerate(batch.token_ids) if len(tokens) == 1
                   and not (prompt_lens and batch.num_computed_tokens[i] < prompt_lens[i] - 1)]
        taken = set(decodes)
        prefills = [i for i in range(len(batch.token_ids)) if i not in taken]
        input_ids: list[int] = []
        positions: list[int] = []
        sample_index: list[int] = []
        sampled: list[tuple[int, int, int]] = []
        for i in decodes + prefills:
            start, tokens = batch.num_computed_tokens[i], batch.token_ids[i]
            end = start + len(tokens)
            input_ids.extend(tokens)
            positions.extend(range(start, end))
            if end >= batch.num_tokens[i]:  # reached the last real token: sample (or verify)
                rows = end - batch.num_tokens[i] + 1  # the last real token + each draft
                first = len(input_ids) - rows
                sampled.append((i, len(sample_index), rows))
                sample_index.extend(range(first, first + rows))
        meta = self._attention_metadata(batch, decodes, prefills, batch.block_ids)
        if len(self.kv_cache_groups) > 1:  # one metadata per group: its own block tables
            grouped([meta] + [
                self._attention_metadata(batch, decodes, prefills,
                                         [tables[g - 1] for tables in batch.group_block_ids])
                for g in range(1, len(self.kv_cache_groups))], self.layer_groups)
        if self.device.type != "cpu":
            for group_meta in meta.group_metas or [meta]:
                self._move_to_device(group_meta)
        return StepInputs(torch.tensor(input_ids, dtype=torch.long).to(self.device),
                          torch.tensor(positions, dtype=torch.long).to(self.device), meta,
                          sample_index, sampled)

    def _attention_metadata(self, batch: StepBatch, decodes: list[int], prefills: list[int],
                            block_ids: list[list[int]]) -> AttentionMetadata:
        """The step's metadata over one KV cache group's block tables (`block_ids`)."""
        prompt_lens = batch.num_prompt_tokens
        slot_mapping: list[int] = []
        for i in decodes + prefills:
            start = batch.num_computed_tokens[i]
            slot_mapping.extend(self._slots(block_ids[i], start, start + len(batch.token_ids[i])))
        meta = AttentionMetadata(slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
                                 num_decode_tokens=len(decodes))
        if decodes:
            self._decode_metadata(meta, batch, decodes, block_ids)
        offset = len(decodes)
        bs = self.block_size
        for i in prefills:
            n = len(batch.token_ids[i])
            ctx = batch.num_computed_tokens[i] + n
            table = torch.tensor(block_ids[i][:-(-ctx // bs)], dtype=torch.long)
            start = batch.num_computed_tokens[i]
            prompt_rows = min(max(prompt_lens[i] - 1 - start, 0), n) if prompt_lens else None
            meta.prefills.append(PrefillChunk(offset, n, ctx, table, prompt_rows))
            offset += n
        return meta

    def _move_to_device(self, meta: AttentionMetadata) -> None:
        if self.attention.name == "triton":  # int32 tables on the device, built once per step
            meta.kernel = build_kernel_metadata(meta, self.device)
        else:
            if meta.decode_block_tables is not None:
                meta.decode_block_tables = meta.decode_block_tables.to(self.device,
                                                                       non_blocking=True)
            for chunk in meta.prefills:
                chunk.block_table = chunk.block_table.to(self.device, non_blocking=True)
        meta.slot_mapping = meta.slot_mapping.to(self.device, non_blocking=True)

    def _decode_metadata(self, meta: AttentionMetadata, batch: StepBatch,
                         decodes: list[int], block_ids: list[list[int]]) -> None:
        tables = [block_ids[i] for i in decodes]
        width = max(len(t) for t in tables)
        meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                                dtype=torch.long)
        meta.decode_context_lens = torch.tensor([batch.num_computed_tokens[i] + 1
                                                 for i in decodes])

    # -- execution -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_batch(self, batch: StepBatch) -> tuple[StepInputs, torch.Tensor | None]:
        """The forward pass; logits only at the rows sampling needs (None if there are none,
        and on tensor-parallel ranks other than 0)."""
        inputs = self.prepare(batch)
        hidden = self.forward_pass(inputs.input_ids, inputs.positions, self.kv_caches,
                                   inputs.meta)
        if not inputs.sampled:
            return inputs, None
        # sampling runs on the logits' device: only sampled ids (and logprobs) reach the host
        return inputs, self.forward_pass.compute_logits(hidden[inputs.sample_index])

    def forward(self, scheduled: list[tuple[Sequence, int]], batch: StepBatch | None = None
                ) -> tuple[StepInputs, torch.Tensor | None]:
        """forward_batch for scheduled sequences (`batch`: their StepBatch, if already built)."""
        inputs, logits = self.forward_batch(StepBatch.of(scheduled) if batch is None else batch)
        inputs.sampled_seqs = [(scheduled[i][0], first, n) for i, first, n in inputs.sampled]
        return inputs, logits

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]],
                rows: dict[Sequence, list[SamplingRow]],
                batch: StepBatch | None = None) -> dict[Sequence, SeqResult]:
        """Run one step. rows[seq] has one SamplingRow per logits row the sequence needs: one,
        or 1 + drafts when it carries speculative tokens to verify."""
        inputs, logits = self.forward(scheduled, batch)
        if logits is None:
            return {}
        flat_rows = [r for seq, _, _ in inputs.sampled_seqs for r in rows[seq]]
        logits = self.sampler.process(logits, flat_rows)
        results: dict[Sequence, SeqResult] = {}
        plain = [(seq, first) for seq, first, n in inputs.sampled_seqs if n == 1]
        if plain:
            firsts = [first for _, first in plain]
            plain_rows = [rows[seq][0] for seq, _ in plain]
            # every row, in order (a step without drafts to verify): no copy of the logits
            chosen = logits if firsts == list(range(logits.shape[0])) else \
                logits[torch.tensor(firsts, device=logits.device)]
            out = self.sampler.sample_processed(chosen, plain_rows)
            for i, (seq, _) in enumerate(plain):
                results[seq] = SeqResult(
                    [out.token_ids[i]],
                    None if out.logprobs is None else [out.logprobs[i]],
                    None if out.top_ids is None else [out.top_ids[i]],
                    None if out.top_logprobs is None else [out.top_logprobs[i]])
        for seq, first, n in inputs.sampled_seqs:
            if n > 1:
                results[seq] = self._verify(seq, logits[first:first + n], rows[seq])
        return results

    def _verify(self, seq: Sequence, logits: torch.Tensor,
                rows: list[SamplingRow]) -> SeqResult:
        drafts = seq.spec_token_ids[:logits.shape[0] - 1]
        if seq.params.greedy:
            tokens = verify_greedy(logits, drafts)
        else:
            # k + 1 rows of a few speculating sequences: verified on the host, where the
            # request's generator draws (seeded verification is the same on every device)
            probs = self.sampler.probs(logits, rows).cpu()
            generator = seq.generator or self.sampler.generator
            draft_probs = seq.spec_draft_probs
            if draft_probs is not None:
                draft_probs = draft_probs[:len(drafts)]
            tokens = verify_sampled(probs, drafts, draft_probs, generator)
        picked = torch.tensor(tokens)
        out = self.sampler.with_logprobs(SamplerOutput(tokens), logits[:len(tokens)], picked,
                                         rows[:len(tokens)])
        return SeqResult(tokens, out.logprobs, out.top_ids, out.top_logprobs)
