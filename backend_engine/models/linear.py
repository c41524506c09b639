"""Row-count-aware matmul for CPU inference.

`y = x @ W^T` (F.linear) and `y = (W @ x^T)^T` compute the same product, but CPU BLAS libraries
pick very different kernels for them when x has few rows: on the reference CPU (oneDNN/MKL,
AVX512) the second form is 1.3-1.7x faster for 2-4 fp32 rows, 1.2x faster for 16-64 rows in
both fp32 and bf16, and 1.2-1.3x *slower* for 2-9 bf16 rows. Decode steps (one row per
sequence) and speculative verification (1 + k rows) live exactly in that range, so the choice is
made per weight shape and per power-of-two row bucket by timing both forms once, when the model
loads. On CUDA (and for big row counts) F.linear is used as is.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

BUCKETS = (2, 4, 8, 16, 32, 64, 128)
MARGIN = 0.95  # the transposed form must be at least 5 % faster to be chosen


def _bucket(rows: int) -> int:
    return 1 << (rows - 1).bit_length()


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


class RowAwareLinear:
    """Call as `linear(x, weight, bias)`; after `calibrate`, each (shape, bucket) uses the faster
    of the two forms. Uncalibrated, it is F.linear."""

    def __init__(self) -> None:
        self._transposed: set[tuple[tuple[int, int], int]] = set()

    def calibrate(self, weights: list[torch.Tensor], repeats: int = 7) -> None:
        seen: set[tuple[int, int]] = set()
        for weight in weights:
            if weight.device.type != "cpu" or weight.dim() != 2:
                continue
            shape = tuple(weight.shape)
            if shape in seen:
                continue
            seen.add(shape)
            reps = repeats if weight.numel() < 8_000_000 else 3  # the lm_head is slow to time
            for rows in BUCKETS:
                x = torch.randn(rows, shape[1], dtype=weight.dtype)
                direct = lambda: F.linear(x, weight)  # noqa: E731
                flipped = lambda: torch.matmul(weight, x.t()).t().contiguous()  # noqa: E731
                direct(), flipped()  # warm both code paths
                # interleave so a noisy neighbour hurts both forms alike
                t_direct = t_flipped = 0.0
                for _ in range(2):
                    t_direct += _median_time(direct, reps)
                    t_flipped += _median_time(flipped, reps)
                if t_flipped < MARGIN * t_direct:
                    self._transposed.add((shape, rows))

    def transposed(self, shape: tuple[int, int], rows: int) -> bool:
        return rows > 1 and rows <= BUCKETS[-1] and (shape, _bucket(rows)) in self._transposed

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 2 and self.transposed(tuple(weight.shape), x.shape[0]):
            y = torch.matmul(weight, x.t()).t().contiguous()
            return y if bias is None else y + bias
        return F.linear(x, weight, bias)
