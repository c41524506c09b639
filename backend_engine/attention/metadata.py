"""Per-step attention metadata, built once by the model runner and shared by every layer.

Tokens of a step are laid out decodes first (one query each), then prefill chunks (a prompt
chunk, or a decode row plus speculative drafts to verify). Every sequence's context is named by
its block table, so building the metadata costs O(blocks), never O(context tokens), and the
backends read K/V from the paged cache by block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillChunk:
    query_start: int  # offset of the chunk's first token in the step's flat token list
    query_len: int
    context_len: int  # cached prefix + this chunk
    block_table: torch.Tensor  # [ceil(context_len / block_size)] the context's blocks, in order
    prompt_rows: int | None = None  # leading rows that are prompt tokens but the prompt's last
    #   (the rest: the last prompt token, generated tokens recomputed, or a decode row and its
    #   drafts), which may take a form of their own (accel/forward.py); None: all of them


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] (0-padded)
    decode_context_lens: torch.Tensor | None = None  # [num_decodes], on the host
    prefills: list[PrefillChunk] = field(default_factory=list)
    kernel: KernelMetadata | None = None  # built once per step by the Triton backend (or runner)
    scratch: dict = field(default_factory=dict)  # per-step values a backend derives once
    # With several KV cache groups (kv_cache_groups.py): each group's metadata (the first is
    # this one, group 0's) and each layer's group; the rows are the same in every group.
    group_metas: list[AttentionMetadata] | None = field(default=None, repr=False, compare=False)
    layer_groups: list[int] | None = None

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata of the KV cache group that holds layer `layer`."""
        return self if self.group_metas is None else self.group_metas[self.layer_groups[layer]]

    def prefill_part(self) -> AttentionMetadata:
        """The prefill chunks alone, their rows counted from 0 (for decode rows run apart)."""
        if self.group_metas is None:
            return self._prefill_part()
        return grouped([m._prefill_part() for m in self.group_metas], self.layer_groups)

    def _prefill_part(self) -> AttentionMetadata:
        nd = self.num_decode_tokens
        return AttentionMetadata(self.slot_mapping[nd:], prefills=[
            PrefillChunk(c.query_start - nd, c.query_len, c.context_len, c.block_table,
                         c.prompt_rows) for c in self.prefills])

    def split_prompt_rows(self) -> tuple[RowsPart, RowsPart]:
        """(the prompt tokens' rows, every other row), each with metadata of its own that
        counts its rows from 0; a chunk holding both splits in two, its prompt rows first (run
        that part first: the other's attention reads its K/V). Decode rows are not prompt
        rows. Host-side (CPU) metadata only."""
        if self.group_metas is None:
            return self._split_prompt_rows()
        splits = [m._split_prompt_rows() for m in self.group_metas]
        for part in (0, 1):
            grouped([split[part].meta for split in splits], self.layer_groups)
        return splits[0]

    def _split_prompt_rows(self) -> tuple[RowsPart, RowsPart]:
        prompt_rows: list[int] = []
        other_rows: list[int] = list(range(self.num_decode_tokens))
        prompt_chunks: list[PrefillChunk] = []
        other_chunks: list[PrefillChunk] = []
        for c in self.prefills:
            n = c.query_len if c.prompt_rows is None else c.prompt_rows
            if n:
                prompt_chunks.append(PrefillChunk(len(prompt_rows), n, c.context_len
                                                  - (c.query_len - n), c.block_table, n))
                prompt_rows.extend(range(c.query_start, c.query_start + n))
            if n < c.query_len:
                other_chunks.append(PrefillChunk(len(other_rows), c.query_len - n,
                                                 c.context_len, c.block_table, 0))
                other_rows.extend(range(c.query_start + n, c.query_start + c.query_len))
        prompt = torch.tensor(prompt_rows, dtype=torch.long)
        other = torch.tensor(other_rows, dtype=torch.long)
        return (RowsPart(prompt, AttentionMetadata(self.slot_mapping[prompt],
                                                   prefills=prompt_chunks)),
                RowsPart(other, AttentionMetadata(
                    self.slot_mapping[other], self.num_decode_tokens, self.decode_block_tables,
                    self.decode_context_lens, other_chunks)))

    @property
    def max_decode_context_len(self) -> int:
        lens = self.decode_context_lens
        return 0 if lens is None or not len(lens) else int(lens.max())


def grouped(metas: list[AttentionMetadata], layer_groups: list[int]) -> AttentionMetadata:
    """Group 0's metadata (metas[0]) carrying every group's: metas[g] is group g's."""
    metas[0].group_metas, metas[0].layer_groups = metas, layer_groups
    return metas[0]


@dataclass(slots=True)
class RowsPart:
    """Some of a step's rows (indices into its flat token list) and their own metadata."""
    rows: torch.Tensor  # long [n]
    meta: AttentionMetadata


@dataclass(slots=True)
class KernelMetadata:
    """The step's metadata as the Triton kernels read it: int32 tensors on the model's device,
    plus the host-side maxima that size the kernel grids (so no kernel launch syncs)."""
    device: torch.device
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor | None  # [num_decodes]
    max_decode_context_len: int
    prefill_block_tables: torch.Tensor | None  # [num_prefills, max_blocks]
    prefill_query_starts: torch.Tensor | None  # [num_prefills] first row of each chunk
    prefill_query_lens: torch.Tensor | None  # [num_prefills]
    prefill_context_lens: torch.Tensor | None  # [num_prefills] cached prefix + chunk
    max_prefill_query_len: int


def _int32(values, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32).to(device, non_blocking=True)


def _padded_tables(tables: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int32)
    for i, table in enumerate(tables):
        out[i, :len(table)] = table
    return out


def build_kernel_metadata(meta: AttentionMetadata, device: torch.device | str) -> KernelMetadata:
    """Derive the kernels' view of a step from the fields the torch path uses, so a runner that
    fills AttentionMetadata needs to know nothing about kernels."""
    device = torch.device(device)
    decode_tables = decode_lens = None
    max_decode = 0
    if meta.num_decode_tokens:
        if meta.decode_block_tables is None or meta.decode_context_lens is None:
            raise ValueError("decode steps need decode_block_tables and decode_context_lens")
        decode_tables = _int32(meta.decode_block_tables, device)
        decode_lens = _int32(meta.decode_context_lens, device)
        max_decode = int(meta.decode_context_lens.max())
    tables = starts = lens = contexts = None
    max_query = 0
    if meta.prefills:
        chunks = meta.prefills
        tables = _padded_tables([c.block_table.cpu() for c in chunks]).to(device,
                                                                          non_blocking=True)
        starts = _int32([c.query_start for c in chunks], device)
        lens = _int32([c.query_len for c in chunks], device)
        contexts = _int32([c.context_len for c in chunks], device)
        max_query = max(c.query_len for c in chunks)
    return KernelMetadata(device, decode_tables, decode_lens, max_decode, tables, starts, lens,
                          contexts, max_query)
