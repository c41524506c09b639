"""Attention over paged KV with Triton kernels: the CUDA path. Same contract as TorchAttention;
the step's kernel metadata is built on the first layer's call and reused by the others."""

from __future__ import annotations

import torch

from backend_engine.attention.metadata import (AttentionMetadata, KernelMetadata,
                                               build_kernel_metadata)
from backend_engine.accel.cuda.common import interpreting
from backend_engine.accel.cuda.decode_attention import paged_decode_attention
from backend_engine.accel.cuda.prefill_attention import paged_prefill_attention
from backend_engine.accel.cuda.store_kv import store_kv


class TritonAttention:
    name = "triton"

    def __init__(self, device: str = "cuda"):
        if not device.startswith("cuda") and not interpreting():
            raise RuntimeError(f"the triton attention backend runs on CUDA, not {device!r} "
                               "(on CPU only under TRITON_INTERPRET=1, for tests)")

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping.to(key.device, non_blocking=True))

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
        kernel = self._kernel_metadata(meta, query.device)
        out = torch.empty_like(query)
        nd = meta.num_decode_tokens
        if nd:
            paged_decode_attention(query[:nd], k_cache, v_cache, kernel.decode_block_tables,
                                   kernel.decode_context_lens, scale,
                                   kernel.max_decode_context_len, out=out[:nd], window=window)
        if meta.prefills:
            paged_prefill_attention(query, k_cache, v_cache, kernel.prefill_block_tables,
                                    kernel.prefill_query_starts, kernel.prefill_query_lens,
                                    kernel.prefill_context_lens, scale,
                                    kernel.max_prefill_query_len, out=out, window=window)
        return out

    @staticmethod
    def _kernel_metadata(meta: AttentionMetadata, device: torch.device) -> KernelMetadata:
        if meta.kernel is None or meta.kernel.device != device:
            meta.kernel = build_kernel_metadata(meta, device)
        return meta.kernel
