"""Blocks in and out of the paged KV tensors: one block's K and V of every layer as one
contiguous [layers, 2, block_size, kv_heads, head_dim] array, the unit that travels."""

from __future__ import annotations

import numpy as np
import torch

from backend_engine.kv_transfer.wire import KVLayout

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class BlockIO:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], model: str):
        self.kv_caches = kv_caches
        key = kv_caches[0][0]
        _, block_size, heads, head_dim = key.shape
        self.dtype = key.dtype
        self.device = key.device
        self.layout = KVLayout(model, block_size, len(kv_caches), heads, head_dim,
                               DTYPE_NAMES[key.dtype])
        self.block_shape = (len(kv_caches), 2, block_size, heads, head_dim)

    def read(self, block_ids: list[int]) -> torch.Tensor:
        """A new host tensor [n, layers, 2, block_size, heads, head_dim] with the blocks' K/V."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        out = torch.empty((len(block_ids), *self.block_shape), dtype=self.dtype)
        for layer, (key, value) in enumerate(self.kv_caches):
            out[:, layer, 0].copy_(key.index_select(0, ids))
            out[:, layer, 1].copy_(value.index_select(0, ids))
        return out

    def write(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Store [n, layers, 2, ...] block data into the given blocks."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(self.device)
        for layer, (key, value) in enumerate(self.kv_caches):
            key.index_copy_(0, ids, data[:, layer, 0])
            value.index_copy_(0, ids, data[:, layer, 1])

    @staticmethod
    def frames(chunk: torch.Tensor) -> list[memoryview]:
        """One zero-copy byte view per block of a chunk from `read`."""
        raw = chunk.view(torch.uint8).reshape(chunk.shape[0], -1).numpy()
        return [memoryview(row) for row in raw]

    def from_frames(self, buffers: list[memoryview]) -> torch.Tensor:
        """Block frames (as sent) back into a [n, layers, 2, ...] tensor (one copy)."""
        flat = torch.empty((len(buffers), self.layout.block_bytes), dtype=torch.uint8)
        rows = flat.numpy()
        for i, buf in enumerate(buffers):  # numpy reads the (read-only) frame without a warning
            rows[i] = np.frombuffer(buf, dtype=np.uint8)
        return flat.view(self.dtype).reshape(len(buffers), *self.block_shape)
