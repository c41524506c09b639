"""A synthetic step of a given shape over a runner's KV cache (block contents are irrelevant):
what start-up calibration times and CUDA memory profiling measures. Runs before any request."""

from __future__ import annotations

import torch

from backend_engine.attention.metadata import AttentionMetadata, PrefillChunk
from backend_engine.step_cost import StepShape


def step_inputs(runner, shape: StepShape, max_model_len: int
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int]:
    """Token ids, positions, metadata and logits rows of a step of this shape on `runner` (a
    ModelRunner: its device, block size, num_blocks)."""
    bs, device = runner.block_size, runner.device
    rows = shape.decode_rows
    context = shape.context_tokens // rows if rows else 0
    prefill = shape.prefill_tokens
    cached = shape.attention_pairs // prefill - prefill if prefill else 0
    need = max(-(-(context + 1) // bs), -(-(cached + prefill) // bs), 1)
    if need > runner.num_blocks or max(context + 1, cached + prefill) > max_model_len:
        raise ValueError("the KV cache or the context is too small for this step shape")
    table = torch.arange(need)
    positions = [context] * rows + list(range(cached, cached + prefill))
    slots = torch.tensor(positions, dtype=torch.long)  # rows share the blocks: fine for timing
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=rows)
    if rows:
        meta.decode_block_tables = table.repeat(rows, 1)
        meta.decode_context_lens = torch.full((rows,), context + 1)
    if prefill:
        meta.prefills.append(PrefillChunk(rows, prefill, cached + prefill, table))
    if device.type != "cpu":
        runner._move_to_device(meta)
    ids = torch.zeros(len(positions), dtype=torch.long, device=device)
    return ids, torch.tensor(positions, device=device), meta, rows + (1 if prefill else 0)
