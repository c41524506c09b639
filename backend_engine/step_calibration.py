"""Time a few synthetic steps on the loaded model at start-up, so the step cost model starts from
this machine's own numbers. Runs before any request: the KV blocks it writes hold nothing yet."""

from __future__ import annotations

import time

import torch

from backend_engine.model_runner import ModelRunner
from backend_engine.step_cost import StepCostModel, StepShape, calibration_shapes
from backend_engine.synthetic_step import step_inputs


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
