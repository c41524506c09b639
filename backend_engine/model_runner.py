"""The model runner: owns the weights and the paged KV cache, turns a scheduled batch into
input tensors and attention metadata, runs the forward pass and samples. No policy here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from backend_engine.attention.backend import get_attention_backend
from backend_engine.attention.metadata import (AttentionMetadata, PrefillChunk,
                                               build_kernel_metadata)
from backend_engine.config import EngineConfig
from backend_engine.models.llama import LlamaModel
from backend_engine.quant.loader import load_weights, resolve_quantization
from backend_engine.sampler import Sampler, SamplerOutput, SamplingRow
from backend_engine.sequence import Sequence
from backend_engine.spec_decode.rejection import verify_greedy, verify_sampled

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_index: list[int]  # flat indexes of the tokens whose logits are needed
    sampled_seqs: list[tuple[Sequence, int, int]]  # (seq, first row, number of rows)


@dataclass(slots=True)
class SeqResult:
    """What one step produced for a sequence: sampled (or verified) tokens and logprobs."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, folder: Path, hf_config, max_model_len: int):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.block_size = config.block_size
        self.attention = get_attention_backend(config.attention_backend, config.device)
        quantization = resolve_quantization(config.quantization, hf_config, folder)
        self.model = LlamaModel(hf_config, load_weights(folder, hf_config, quantization),
                                self.attention, max_model_len, self.dtype, config.device,
                                quantization=quantization,
                                quant_group_size=config.quantization_group_size)
        self.num_blocks = config.num_kv_blocks or self._blocks_for_memory(config.kv_cache_memory_gb)
        shape = (self.num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(self.model.num_layers)]
        self.sampler = Sampler(config.seed)

    def _blocks_for_memory(self, gigabytes: float) -> int:
        m = self.model
        per_block = 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim \
            * torch.finfo(self.dtype).bits // 8
        return max(2, int(gigabytes * (1 << 30)) // per_block)

    # -- batch preparation -----------------------------------------------------------------
    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots of positions [start, end): the new tokens of this step only."""
        bs, ids = self.block_size, seq.block_ids
        return [ids[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> StepInputs:
        """Inputs of one step. Python work is O(new tokens + blocks), never O(context)."""
        decodes = [(s, n) for s, n in scheduled if n == 1]
        prefills = [(s, n) for s, n in scheduled if n > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        sample_index: list[int] = []
        sampled: list[tuple[Sequence, int, int]] = []
        for seq, n in decodes + prefills:
            start = seq.num_computed_tokens
            real = seq.token_ids[start:start + n]  # the new tokens, then any drafts
            input_ids.extend(real)
            if len(real) < n:
                input_ids.extend(seq.spec_token_ids[:n - len(real)])
            positions.extend(range(start, start + n))
            slot_mapping.extend(self._slots(seq, start, start + n))
            if start + n >= seq.num_tokens:  # reached the last real token: sample (or verify)
                first = len(input_ids) - (start + n - seq.num_tokens) - 1
                rows = start + n - seq.num_tokens + 1  # the last real token + each draft
                sampled.append((seq, len(sample_index), rows))
                sample_index.extend(range(first, first + rows))
        meta = AttentionMetadata(slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
                                 num_decode_tokens=len(decodes))
        if decodes:
            self._decode_metadata(meta, [s for s, _ in decodes])
        offset = len(decodes)
        bs = self.block_size
        for seq, n in prefills:
            ctx = seq.num_computed_tokens + n
            table = torch.tensor(seq.block_ids[:-(-ctx // bs)], dtype=torch.long)
            meta.prefills.append(PrefillChunk(offset, n, ctx, table))
            offset += n
        if self.device.type != "cpu":
            self._move_to_device(meta)
        return StepInputs(torch.tensor(input_ids, dtype=torch.long).to(self.device),
                          torch.tensor(positions, dtype=torch.long).to(self.device), meta,
                          sample_index, sampled)

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

    def _decode_metadata(self, meta: AttentionMetadata, seqs: list[Sequence]) -> None:
        width = max(len(s.block_ids) for s in seqs)
        meta.decode_block_tables = torch.tensor(
            [s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs], dtype=torch.long)
        meta.decode_context_lens = torch.tensor([s.num_computed_tokens + 1 for s in seqs])

    # -- execution -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, scheduled: list[tuple[Sequence, int]]
                ) -> tuple[StepInputs, torch.Tensor | None]:
        """The forward pass; logits only at the rows sampling needs (None if there are none)."""
        inputs = self.prepare(scheduled)
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches,
                                    inputs.meta)
        if not inputs.sampled_seqs:
            return inputs, None
        # sampling runs on the host (per-request CPU generators make seeds reproducible)
        return inputs, self.model.compute_logits(hidden[inputs.sample_index]).cpu()

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]],
                rows: dict[Sequence, list[SamplingRow]]) -> dict[Sequence, SeqResult]:
        """Run one step. rows[seq] has one SamplingRow per logits row the sequence needs: one,
        or 1 + drafts when it carries speculative tokens to verify."""
        inputs, logits = self.forward(scheduled)
        if logits is None:
            return {}
        flat_rows = [r for seq, _, _ in inputs.sampled_seqs for r in rows[seq]]
        logits = self.sampler.process(logits, flat_rows)
        results: dict[Sequence, SeqResult] = {}
        plain = [(seq, first) for seq, first, n in inputs.sampled_seqs if n == 1]
        if plain:
            index = torch.tensor([first for _, first in plain])
            plain_rows = [rows[seq][0] for seq, _ in plain]
            out = self.sampler.sample_processed(logits[index], plain_rows)
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
            probs = self.sampler.probs(logits, rows)
            generator = seq.generator or self.sampler.generator
            draft_probs = seq.spec_draft_probs
            if draft_probs is not None:
                draft_probs = draft_probs[:len(drafts)]
            tokens = verify_sampled(probs, drafts, draft_probs, generator)
        picked = torch.tensor(tokens)
        out = self.sampler.with_logprobs(SamplerOutput(tokens), logits[:len(tokens)], picked,
                                         rows[:len(tokens)])
        return SeqResult(tokens, out.logprobs, out.top_ids, out.top_logprobs)
