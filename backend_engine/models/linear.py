"""Row-count-aware matmul for CPU inference.

`y = x @ W^T` (F.linear) and `y = (W @ x^T)^T` compute the same product, but CPU BLAS libraries
pick very different kernels for them when x has few rows. Measured on the reference CPU
(oneDNN/MKL, AVX512, 2 threads) with weights streamed from memory as in a real decode step
(every layer's weight in turn, not one cache-hot matrix): for fp32, one row (a GEMV) runs at
about half the memory bandwidth of the same product padded to two rows in the transposed form
(SmolLM2-135M: 0.81 ms against 0.45 ms per layer; the 49152 x 576 lm_head 6.9 against 2.4 ms),
and the transposed form is 2-3.5x faster for 2-4 rows and 1.3-1.6x for 9; in bf16, F.linear is
the fastest for 1-9 rows. Decode steps (one row per sequence) and speculative verification
(1 + k rows) live exactly in that range, so the form is chosen per weight shape and per
power-of-two row bucket by timing the candidates over the model's own weights, once per process
(the choice belongs to the machine, not to an engine: engines in one process share it). On CUDA
(and for big row counts) F.linear is used as is.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger(__name__)
_lock = threading.Lock()
_measured: dict[tuple[tuple[int, int], torch.dtype, int], str] = {}  # per process


def _bucket(rows: int) -> int:
    return 1 << (rows - 1).bit_length()


def _fastest(weights: list[torch.Tensor], rows: int, repeats: int) -> str:
    """Time each candidate form over a pass through all `weights` (so they come from memory,
    as in a decode step, not from cache); passes alternate between forms, and each form's
    fastest pass counts, since a noisy neighbour can only slow a pass down."""
    x = torch.randn(rows, weights[0].shape[1], dtype=weights[0].dtype)
    names = ["linear", "pad_linear", "pad_flip"] if rows == 1 else ["linear", "flip"]
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        FORMS[name](x, weights[0])  # warm each code path
    for _ in range(repeats):
        for name in names:
            form = FORMS[name]
            start = time.perf_counter()
            for weight in weights:
                form(x, weight)
            times[name].append(time.perf_counter() - start)
    fastest = {name: min(t) for name, t in times.items()}  # interference only adds time
    best = min(names, key=fastest.__getitem__)
    return best if fastest[best] < MARGIN * fastest["linear"] else "linear"


class RowAwareLinear:
    """Call as `linear(x, weight, bias)`; after `calibrate`, each (shape, bucket) uses the
    fastest measured form. Uncalibrated, it is F.linear."""

    def __init__(self) -> None:
        self._choice: dict[tuple[tuple[int, int], int], str] = {}  # only non-"linear" choices

    def calibrate(self, groups: list[list[torch.Tensor]], repeats: int = 5) -> None:
        """groups: lists of same-shape weights (e.g. every layer's qkv weight)."""
        for weights in groups:
            weights = [w for w in weights if w.device.type == "cpu" and w.dim() == 2]
            if not weights:
                continue
            shape, dtype = tuple(weights[0].shape), weights[0].dtype
            for rows in BUCKETS:
                key = (shape, dtype, rows)
                with _lock:
                    if key not in _measured:
                        _measured[key] = _fastest(weights, rows, repeats)
                    name = _measured[key]
                if name != "linear":
                    self._choice[(shape, rows)] = name
        log.debug("row-aware matmul forms: %s", self._choice)

    def form(self, shape: tuple[int, int], rows: int) -> str:
        """The name of the form used for this weight shape and row count."""
        if rows > BUCKETS[-1]:
            return "linear"
        return self._choice.get((shape, _bucket(rows)), "linear")

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 2:
            name = self.form(tuple(weight.shape), x.shape[0])
            if name != "linear":
                y = FORMS[name](x, weight)
                return y if bias is None else y + bias
        return F.linear(x, weight, bias)
