"""Decode attention over paged KV, compiled by torch.compile (Inductor's C++ code on CPU).

Written as plain indexing (`k_cache[block_tables]`), the gather would copy each row's context
out of the pool; compiled, Inductor fuses the block-table lookup into the score and value
reductions, so K and V are read once, in place, from their blocks. On the 2-core EPYC this
project runs on, one layer of 64 decodes at 500-2,000 tokens of context (SmolLM2-135M) takes
~23 ms compiled against ~40 ms for the grouped eager path (torch_backend.py);
`python -m benchmarks.decode_attention` measures it.

Shapes are dynamic in the rows and blocks of a call and in the pool's blocks (marked, not
guessed, and without duck sizing), and padded to at least two rows and blocks, so that the 0/1
specialisation never recompiles. `warm_up` compiles at start-up with the engine's own scale
and inference tensors (both are guarded), ~10 s the first time and ~4 s from Inductor's disk
cache. Any failure to compile (no C++ compiler) leaves the eager path in charge, with one
warning.
"""

from __future__ import annotations

import logging
import types

import torch
from torch.fx.experimental import _config as fx_config

log = logging.getLogger("kvgate.engine")


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """query [B, H, D]; caches [N, bs, KVH, D]; block_tables [B, nb]; context_lens [B]."""
    batch, num_blocks = block_tables.shape
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    heads = query.shape[1]
    group = heads // kv_heads
    q = query.view(batch, kv_heads, group, 1, 1, head_dim).float()
    k = k_cache[block_tables].permute(0, 3, 1, 2, 4).unsqueeze(2)  # [B, KVH, 1, nb, bs, D]
    scores = (q * k.float()).sum(-1) * scale  # [B, KVH, G, nb, bs]
    positions = torch.arange(num_blocks * block_size, device=query.device).view(num_blocks, block_size)
    past = positions[None, None, None] >= context_lens.view(batch, 1, 1, 1, 1)
    scores = scores.masked_fill(past, float("-inf")).view(batch, kv_heads, group, -1)
    probs = torch.softmax(scores, dim=-1).view(batch, kv_heads, group, num_blocks, block_size, 1)
    v = v_cache[block_tables].permute(0, 3, 1, 2, 4).unsqueeze(2)  # [B, KVH, 1, nb, bs, D]
    out = (probs * v.float()).sum((-3, -2))  # [B, KVH, G, D]
    return out.reshape(batch, heads, head_dim).to(query.dtype)


def own_copy(fn: types.FunctionType) -> types.FunctionType:
    """fn with a code object of its own: Dynamo keeps compiled entries (and counts recompiles
    against its limit) per code object, and one process may run many engines (tests do), each
    with its own dtype, heads and scale."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


class CompiledDecode:
    """The compiled function and whether it works here; one per engine (one engine thread)."""

    def __init__(self) -> None:
        self._fn = torch.compile(own_copy(paged_decode), dynamic=False, fullgraph=True)
        self.failed = False

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float) -> torch.Tensor | None:
        """The attention of each row, or None when compilation failed (use the eager path)."""
        if self.failed:
            return None
        batch, num_blocks = block_tables.shape
        pad_rows, pad_blocks = max(0, 2 - batch), max(0, 2 - num_blocks)
        if pad_rows or pad_blocks:  # 0/1 sizes would specialise: pad to two (masked out)
            block_tables = torch.nn.functional.pad(block_tables, (0, pad_blocks, 0, pad_rows))
            context_lens = torch.nn.functional.pad(context_lens, (0, pad_rows), value=1)
            query = torch.nn.functional.pad(query, (0, 0, 0, 0, 0, pad_rows))
        for tensor in (query, block_tables, context_lens, k_cache, v_cache):
            torch._dynamo.mark_dynamic(tensor, 0)  # rows; the pool's blocks (engines differ)
        torch._dynamo.mark_dynamic(block_tables, 1)
        try:
            # no duck sizing: sizes equal at compile time are not taken for one symbol
            with fx_config.patch(use_duck_shape=False):
                out = self._fn(query, k_cache, v_cache, block_tables, context_lens, float(scale))
        except Exception as exc:  # noqa: BLE001 - Inductor raises many kinds; eager always works
            self.failed = True
            log.warning("compiled decode attention is unavailable here (%s: %s); using the "
                        "eager path", type(exc).__name__, str(exc).splitlines()[0][:200])
            return None
        return out[:batch] if pad_rows else out

    def warm_up(self, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                scale: float) -> bool:
        """Compile now (start-up) rather than in a step, for the engine's own scale (a constant
        of the compiled code). True if it works."""
        rows, blocks = 3, 5
        with torch.inference_mode():  # inference tensors, as in the engine's steps
            block_tables = torch.zeros(rows, blocks, dtype=torch.long, device=k_cache.device)
            context_lens = torch.full((rows,), blocks * k_cache.shape[1] - 1,
                                      device=k_cache.device)
            query = torch.zeros(rows, heads, k_cache.shape[-1], dtype=k_cache.dtype,
                                device=k_cache.device)
            return self(query, k_cache, v_cache, block_tables, context_lens, scale) is not None
