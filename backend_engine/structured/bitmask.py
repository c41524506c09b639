"""The step's token bitmask: one row per logits row of a constrained sequence, filled on a worker
thread while the forward pass runs (xgrammar releases the GIL), applied by the sampler on the
logits' device. A mask of a few rows is filled at once instead: handing it to the worker costs
more than filling it. xgrammar is imported where a mask exists (a request passed validation,
so it is installed): the sampler imports this module on replicas without it."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from backend_engine.structured.matcher import SequenceGrammar

# Below this many rows, filling (~20 us a row) is cheaper than waking the worker (~150 us).
BACKGROUND_MIN_ROWS = 4


class StepBitmask:
    def __init__(self, num_rows: int, vocab_size: int):
        import xgrammar as xgr

        self.bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)  # all allowed
        self._future: Future | None = None

    def start(self, executor: Executor, work: list[tuple[SequenceGrammar, int, list[int]]],
              observe: Callable[[float], None] | None = None) -> None:
        """Fill every (grammar, first row, drafts): in the background unless it is small."""
        def fill() -> None:
            begin = time.perf_counter()
            for grammar, row, drafts in work:
                grammar.fill(self.bitmask, row, drafts)
            if observe is not None:
                observe(time.perf_counter() - begin)

        if self.bitmask.shape[0] < BACKGROUND_MIN_ROWS:
            fill()
        else:
            self._future = executor.submit(fill)

    def wait(self) -> None:
        if self._future is not None:
            self._future.result()


@dataclass(slots=True)
class MaskRow:
    """One logits row's place in its step's bitmask."""

    step: StepBitmask
    row: int


def apply_grammar_masks(logits: torch.Tensor, masks: list[MaskRow | None]) -> None:
    """Set the logits of tokens the grammar forbids to -inf (rows without a mask are free)."""
    picked = [(i, m) for i, m in enumerate(masks) if m is not None]
    if not picked:
        return
    for step in {id(m.step): m.step for _, m in picked}.values():
        step.wait()
    import xgrammar as xgr

    bitmask = torch.stack([m.step.bitmask[m.row] for _, m in picked])
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if len(picked) == logits.shape[0]:
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        return
    index = torch.tensor([i for i, _ in picked], device=logits.device)
    rows = logits[index]
    xgr.apply_token_bitmask_inplace(rows, bitmask)
    logits[index] = rows
