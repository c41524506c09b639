"""One attention interface; the torch implementation runs everywhere (the reference), Triton on
CUDA (accel/cuda/attention.py); accel/attention.py picks the one the plan names."""

from __future__ import annotations

from typing import Protocol

import torch

from backend_engine.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write new K/V rows ([tokens, kv_heads, head_dim]) into the paged cache
        ([num_blocks, block_size, kv_heads, head_dim]) at the given slots."""

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
        """Attention of queries ([tokens, heads, head_dim]) over the paged cache, which already
        holds this step's K/V. Returns [tokens, heads, head_dim]. window > 0: a sliding-window
        layer's, each query sees the `window` positions up to its own (transformers'
        `sliding_window`); 0: every position up to its own."""
