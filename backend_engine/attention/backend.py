"""One attention interface; the torch implementation runs everywhere (the reference), Triton on
CUDA (accel/cuda/attention.py)."""

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
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention of queries ([tokens, heads, head_dim]) over the paged cache, which already
        holds this step's K/V. Returns [tokens, heads, head_dim]."""


class AttentionBackendUnavailableError(RuntimeError):
    """The requested backend cannot run here (e.g. triton is not installed)."""


def get_attention_backend(name: str, device: str = "cpu") -> AttentionBackend:
    """"torch" (any device; the reference) or "triton" (CUDA), as the plan names it."""
    if name == "torch":
        from backend_engine.attention.torch_backend import TorchAttention

        return TorchAttention()
    if name == "triton":
        try:
            from backend_engine.accel.cuda.attention import TritonAttention
        except ImportError as exc:
            raise AttentionBackendUnavailableError(
                "the triton attention backend needs the triton package: pip install "
                f"'kvgate[gpu]', or --engine-option attention=torch ({exc})") from exc
        return TritonAttention(device)
    raise ValueError(f"unknown attention backend {name!r}; choose torch or triton")
