"""Time a few synthetic steps on the loaded model at start-up, so the step cost model starts from
this machine's own numbers. Runs before any request: the KV blocks it writes hold nothing yet."""

from __future__ import annotations

import time

import torch

from backend_engine.attention.metadata import AttentionMetadata, PrefillChunk
from backend_engine.model_runner import ModelRunner
from backend_engine.step_cost import StepCostModel, StepShape, calibration_shapes


def step_inputs(runner: ModelRunner, shape: StepShape, max_model_len: int
            ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int]:
    """Token ids, positions, metadata and logits rows of a step of this shape."""
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


@torch.inference_mode()
def time_step(runner: ModelRunner, shape: StepShape, max_model_len: int,
              repeats: int = 2) -> float:
    """Fastest of `repeats` forward passes (with the logits of the rows a real step samples)."""
    ids, positions, meta, logit_rows = step_inputs(runner, shape, max_model_len)
    best = float("inf")
    for _ in range(repeats):
        meta.scratch.clear()
        start = time.perf_counter()
        hidden = runner.forward_pass(ids, positions, runner.kv_caches, meta)
        runner.forward_pass.compute_logits(hidden[-logit_rows:]).cpu()
        best = min(best, time.perf_counter() - start)
    return best


def calibrated_model(runner: ModelRunner, max_model_len: int) -> StepCostModel:
    model = StepCostModel()
    points = []
    for shape in calibration_shapes():
        try:
            points.append((shape, time_step(runner, shape, max_model_len)))
        except ValueError:
            continue  # a KV cache or context smaller than the shape: the online fit takes over
    model.calibrate(points)
    return model
