"""One attention interface; the torch implementation runs everywhere, Triton on CUDA."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from backend_engine.attention.metadata import AttentionMetadata

log = logging.getLogger("kvgate.engine")


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


def _triton_backend(device: str) -> AttentionBackend:
    try:
        from backend_engine.attention.triton_backend import TritonAttention
    except ImportError as exc:
        raise AttentionBackendUnavailableError(
            "attention backend 'triton' needs the triton package: pip install 'kvgate[gpu]' "
            f"({exc})") from exc
    return TritonAttention(device)


def get_attention_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    """"torch", "triton", or "auto": triton on CUDA when it imports, torch otherwise."""
    if name == "auto":
        if device.startswith("cuda"):
            try:
                return _triton_backend(device)
            except AttentionBackendUnavailableError as exc:
                log.warning("falling back to torch attention on %s: %s", device, exc)
        name = "torch"
    if name == "torch":
        from backend_engine.attention.torch_backend import TorchAttention

        return TorchAttention()
    if name == "triton":
        return _triton_backend(device)
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or triton")
