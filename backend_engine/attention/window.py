"""The blocks a sliding-window layer reads: each decode row's block table cut to its window.

A query at position p of a layer with window W sees positions p - W + 1 .. p. Masking the
positions before the window still reads (and multiplies) every block of the context; cut to
the window, a decode row reads at most (W - 1) // block_size + 2 blocks however long its
context, and a prefill chunk the blocks from its first query's window on. The cut tables count
positions from their first block, so the same causal-and-window mask applies to them unchanged.
Host-side (or on the tables' device), once per step and window.
"""

from __future__ import annotations

import torch


def window_blocks(window: int, block_size: int) -> int:
    """The most blocks the window of one query touches."""
    return (window - 1) // block_size + 2


def decode_window(block_tables: torch.Tensor, context_lens: torch.Tensor, window: int,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block tables [B, n], context lens [B]) of decode rows whose last position (context
    length - 1) queries a window of `window` positions: each row's blocks from the first its
    window reads, its length counted from that block. Unchanged where no row's window leaves out
    a block (tables no wider than a window's blocks)."""
    n = window_blocks(window, block_size)
    width = block_tables.shape[1]
    if width <= n:
        return block_tables, context_lens
    lens = context_lens.to(block_tables.device)
    first = (lens - window).clamp(min=0) // block_size  # [B]
    columns = (first.unsqueeze(1) + torch.arange(n, device=block_tables.device)).clamp(
        max=width - 1)  # past a row's own blocks: masked by its length
    return (block_tables.gather(1, columns),
            (lens - first * block_size).to(context_lens.device))


def prefill_window_start(context_len: int, query_len: int, window: int,
                         block_size: int) -> int:
    """The first block a prefill chunk's window reads (its first query sees window positions
    up to its own)."""
    first_query = context_len - query_len
    return max(0, first_query - window + 1) // block_size
