"""Per-step attention metadata, built once by the model runner and shared by every layer.

Tokens of a step are laid out decodes first (one query each), then prefill chunks. Decodes are
attended as one padded batch; each prefill chunk reads its cached prefix through its slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillChunk:
    query_start: int  # offset of the chunk's first token in the step's flat token list
    query_len: int
    context_len: int  # cached prefix + this chunk
    context_slots: torch.Tensor  # [context_len] slot of every context token, in order


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decode_tokens: int = 0
    decode_context_slots: torch.Tensor | None = None  # [num_decodes, max_context] (padded)
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_context] bool, True = attend
    decode_context_lens: torch.Tensor | None = None  # [num_decodes]
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] (kernels)
    prefills: list[PrefillChunk] = field(default_factory=list)
