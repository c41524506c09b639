"""Row-count-aware matmul for CPU inference.

`y = x @ W^T` (F.linear) and `y = (W @ x^T)^T` compute the same product, but CPU BLAS libraries
pick very different kernels for them when x has few rows. Measured on the reference CPU
(oneDNN/MKL, AVX512, 2 threads): the second form is 1.3-1.7x faster for 2-4 fp32 rows and 1.2x
faster for 16-64 rows in fp32 and bf16, but 1.2-1.3x slower for 2-9 bf16 rows; and a single fp32
row of the 49152 x 576 lm_head (a GEMV) takes 6.9 ms where the same product padded to two rows
takes 2.4 ms. Decode steps (one row per sequence) and speculative verification (1 + k rows) live
exactly in that range, so the form is chosen per weight shape and per power-of-two row bucket by
timing the candidates once per process (the choice belongs to the machine, not to an engine, so
engines in one process share it). On CUDA (and for big row counts) F.linear is used as is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
MARGIN = 0.95  # another form must be at least 5 % faster than F.linear to be chosen

Form = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _flip(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(w, x.t()).t().contiguous()


def _pad(form: Form) -> Form:
    def padded(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return form(x.repeat(2, 1), w)[:1]  # a GEMM over 2 rows instead of a GEMV
    return padded


FORMS: dict[str, Form] = {"linear": _linear, "flip": _flip,
                          "pad_linear": _pad(_linear), "pad_flip": _pad(_flip)}

_lock = threading.Lock()
_measured: dict[tuple[tuple[int, int], torch.dtype, int], str] = {}  # per process


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


def _fastest(weight: torch.Tensor, rows: int, repeats: int) -> str:
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    names = ["linear", "pad_linear", "pad_flip"] if rows == 1 else ["linear", "flip"]
    total = dict.fromkeys(names, 0.0)
    for name in names:
        FORMS[name](x, weight)  # warm each code path
    for _ in range(2):  # interleaved, so a noisy neighbour hurts every form alike
        for name in names:
            total[name] += _median_time(lambda: FORMS[name](x, weight), repeats)
    best = min(names, key=total.__getitem__)
    return best if total[best] < MARGIN * total["linear"] else "linear"


class RowAwareLinear:
    """Call as `linear(x, weight, bias)`; after `calibrate`, each (shape, bucket) uses the
    fastest measured form. Uncalibrated, it is F.linear."""

    def __init__(self) -> None:
        self._choice: dict[tuple[tuple[int, int], int], Form] = {}

    def calibrate(self, weights: list[torch.Tensor], repeats: int = 7) -> None:
        for weight in weights:
            if weight.device.type != "cpu" or weight.dim() != 2:
                continue
            shape = tuple(weight.shape)
            reps = repeats if weight.numel() < 8_000_000 else 3  # the lm_head is slow to time
            for rows in BUCKETS:
                key = (shape, weight.dtype, rows)
                with _lock:
                    if key not in _measured:
                        _measured[key] = _fastest(weight, rows, reps)
                    name = _measured[key]
                if name != "linear":
                    self._choice[(shape, rows)] = FORMS[name]

    def form(self, shape: tuple[int, int], rows: int) -> str:
        """The name of the form used for this weight shape and row count."""
        chosen = self._choice.get((shape, _bucket(rows))) if rows <= BUCKETS[-1] else None
        return next((n for n, f in FORMS.items() if f is chosen), "linear")

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if x.dim() == 2 and rows <= BUCKETS[-1]:
            form = self._choice.get((tuple(weight.shape), _bucket(rows)))
            if form is not None:
                y = form(x, weight)
                return y if bias is None else y + bias
        return F.linear(x, weight, bias)
