"""A linear model of one engine step's time, fitted to the steps this replica actually runs.

    seconds = base + per_prefill_token * P + per_decode_row * R
                   + per_context_token * C + per_attention_pair * A + prefill_pass * [P > 0]

P: prefill (and recompute) tokens in the step; R: decode rows (a sequence decoding one token,
or verifying drafts: one row each); C: context tokens the decode rows attend to; A: query x
context pairs of the prefill chunks, in thousands (a chunk's attention grows with its context);
prefill_pass: what a step pays once for holding any prefill rows at all — with the compiled
decode step, a second pass over the weights; with a quantised model's `tiles` prompt form, also
dequantising every weight unless the plan keeps their copies resident (int4's GEMM template
has no such cost, and the fit follows whichever form the plan runs), which a per-token cost
cannot express (fitted as one, it made short chunks look expensive per token, so the budget cut
prompts into short chunks that each paid the whole pass).

It starts from a few timed steps at start-up (`calibration_shapes`) and is refitted from every
real step (a window of recent ones, least squares, coefficients kept >= 0), so it follows the
machine it runs on, including what neighbours take from it. Pure Python + numpy, no tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

REFIT_EVERY = 16  # steps between refits
WINDOW = 512  # recent steps a refit uses (start-up points are always kept)


@dataclass(slots=True, frozen=True)
class StepShape:
    prefill_tokens: int = 0
    decode_rows: int = 0
    context_tokens: int = 0  # summed over decode rows
    attention_pairs: int = 0  # summed over prefill chunks: query_len * context_len (incl. chunk)

    @classmethod
    def of(cls, scheduled: list) -> StepShape:
        """The shape of a scheduled step: (sequence, tokens to run) pairs, before it runs."""
        prefill = rows = context = pairs = 0
        for seq, n in scheduled:
            if seq.num_tokens - seq.num_computed_tokens > 1:  # a prompt chunk or recompute
                prefill += n
                pairs += n * (seq.num_computed_tokens + n)
            else:
                rows += n  # one row, plus one per draft to verify
                context += n * seq.num_tokens
        return cls(prefill, rows, context, pairs)

    def features(self) -> list[float]:
        return [1.0, float(self.prefill_tokens), float(self.decode_rows),
                float(self.context_tokens), self.attention_pairs / 1000.0,
                1.0 if self.prefill_tokens else 0.0]


def calibration_shapes() -> list[StepShape]:
    """Steps timed at start-up: enough spread in each feature for a well-posed first fit."""
    shapes = [StepShape(prefill_tokens=n, attention_pairs=n * n) for n in (16, 64, 160)]
    shapes += [StepShape(decode_rows=r, context_tokens=r * c) for r, c in
               ((1, 64), (4, 512), (16, 128), (16, 512))]
    shapes.append(StepShape(prefill_tokens=64, attention_pairs=64 * 320, decode_rows=8,
                            context_tokens=8 * 256))
    return shapes


class StepCostModel:
    def __init__(self) -> None:
        self.coef = np.zeros(6)
        self._anchor: list[tuple[list[float], float]] = []  # start-up points, always kept
        self._recent: deque[tuple[list[float], float]] = deque(maxlen=WINDOW)
        self._since_fit = 0

    def predict(self, shape: StepShape) -> float:
        return float(np.dot(self.coef, shape.features()))

    @property
    def per_prefill_token_s(self) -> float:
        return float(self.coef[1])

    @property
    def per_attention_pair_s(self) -> float:
        return float(self.coef[4]) / 1000.0

    @property
    def prefill_pass_s(self) -> float:
        return float(self.coef[5])

    def calibrate(self, points: list[tuple[StepShape, float]]) -> None:
        self._anchor = [(s.features(), t) for s, t in points]
        self._fit()

    def observe(self, shape: StepShape, seconds: float) -> None:
        self._recent.append((shape.features(), seconds))
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        rows = self._anchor + list(self._recent)
        if len(rows) < 3:
            return
        x = np.array([f for f, _ in rows])
        y = np.array([t for _, t in rows])
        active = np.ones(x.shape[1], dtype=bool)
        coef = np.zeros(x.shape[1])
        for _ in range(x.shape[1]):  # drop negative terms and refit: a small NNLS
            sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            coef[:] = 0
            coef[active] = sol
            if (sol >= 0).all():
                break
            active[np.flatnonzero(active)[sol < 0]] = False
            active[0] = True  # keep the intercept (clipped below if it goes negative)
        self.coef = np.clip(coef, 0, None)
