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

Quantised weights (backend_engine/quant) come through the same call: their prepared layout names
its kind, and the kind's forms (e.g. int8 weight-only kernel vs dequantise-then-GEMM) are chosen
the same way, per shape and bucket; above the last bucket the last bucket's choice holds. Their
prompt rows may take another form (dequantise + GEMM tiles, int4's GEMM template or integer
sums), chosen once for all row counts (`fastest_prompt_form`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from backend_engine.quant import cpu_template
from backend_engine.quant.prepare import forms as quant_forms
from backend_engine.quant.prepare import prompt_form

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
_measured: dict[tuple, str] = {}  # (shape, dtype or quantised kind, rows) → form; per process


def _bucket(rows: int) -> int:
    return 1 << (rows - 1).bit_length()


def _fastest(candidates: dict[str, Form], weights: list, x: torch.Tensor, repeats: int) -> str:
    """The fastest candidate form over `weights` (`_timings`). The first candidate is the
    default, which another must beat by the margin."""
    fastest = _timings(candidates, weights, x, repeats)
    names = list(candidates)
    best = min(names, key=fastest.__getitem__)
    return best if fastest[best] < MARGIN * fastest[names[0]] else names[0]


def _timings(candidates: dict[str, Form], weights: list, x: torch.Tensor,
             repeats: int) -> dict[str, float]:
    """Time each candidate form over a pass through all `weights` (so they come from memory,
    as in a decode step, not from cache); passes alternate between forms, and each form's
    fastest pass counts, since a noisy neighbour can only slow a pass down."""
    names = list(candidates)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        candidates[name](x, weights[0])  # warm each code path
    for _ in range(repeats):
        for name in names:
            form = candidates[name]
            start = time.perf_counter()
            for weight in weights:
                form(x, weight)
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}  # interference only adds time


PROMPT_ROWS = 256  # rows fastest_prompt_form times: a prompt chunk under load (budget 512)
PROMPT_WEIGHTS = 4  # weights of each group it times them over


def fastest_prompt_form(groups: list[list], dtype: torch.dtype = torch.float32,
                        template: Form | None = None, repeats: int = 3) -> str:
    """The form prompt rows of quantised weights take: "kernel" (the weight-only kernel),
    "gemm" (dequantise, then GEMM in row tiles), "int8" (integer sums) or, where `template`
    is given (the compiled int4 GEMM template, as a form over the first weights of each
    group), "template": the fastest at `PROMPT_ROWS` rows over the first `PROMPT_WEIGHTS`
    weights of each group (of the qkv, o, gate_up and down weights), summed, if it beats the
    kernel by the margin.
    Measured once per process and shape. Prompt rows take one form whatever their count (a
    row's bits may not depend on its chunk), so it is chosen once for all, not per bucket."""
    total: dict[str, float] = {}
    for weights in groups:
        shape, kind = _key(weights[0])
        key = ("prompt", shape, kind, dtype, template is not None)
        with _lock:
            if key not in _measured:
                x = torch.randn(PROMPT_ROWS, shape[1], dtype=dtype)
                candidates = {"kernel": next(iter(quant_forms(kind).values())),
                              "gemm": prompt_form(kind), "int8": prompt_form(kind, "int8")}
                if template is not None:
                    candidates["template"] = template
                # compute-bound at this row count: a few layers' weights tell
                _measured[key] = _timings(candidates, weights[:PROMPT_WEIGHTS], x, repeats)
            for name, seconds in _measured[key].items():
                total[name] = total.get(name, 0.0) + seconds
    log.info("prompt rows at %d rows: %s", PROMPT_ROWS,
             ", ".join(f"{name} {1e3 * seconds:.1f} ms" for name, seconds in total.items()))
    best = min(total, key=total.__getitem__)
    return best if total[best] < MARGIN * total["kernel"] else "kernel"


def choose_prompt_form(groups: list[list], mode: str, dtype: torch.dtype,
                       compile_templates: bool = True) -> str:
    """`--quantized-prefill` auto (measured: `fastest_prompt_form`; the template a candidate
    with `compile_templates` and weights large enough to pay its compile), dequant, int8 or
    template (int4 weights, else dequant) → the form of the prompt rows over these groups of
    weights; a chosen template is compiled for every weight now (cpu_template.py), all or
    none, and attached to them."""
    weights = [w for group in groups for w in group]
    if mode == "template":
        template = all(cpu_template.eligible(w, 0) for w in weights)
    else:
        template = mode == "auto" and compile_templates and all(map(cpu_template.eligible,
                                                                    weights))
    compiled: dict[int, cpu_template.TemplateMatmul] = {}

    def compile_(ws: list) -> bool:
        for w in ws:
            if id(w) not in compiled:
                built = cpu_template.compile_for(w)
                if built is None:
                    return False
                compiled[id(w)] = built
        return True

    if mode == "auto":
        timed = [w for group in groups for w in group[:PROMPT_WEIGHTS]]
        template = template and compile_(timed)
        form = fastest_prompt_form(groups, dtype,
                                   (lambda x, w: compiled[id(w)](x)) if template else None)
    elif mode == "int8":
        form = "int8"
    else:
        form = "template" if template else "gemm"
    if form == "template":
        if compile_(weights):
            for w in weights:
                cpu_template.attach(w, compiled[id(w)])
        else:
            form = "gemm"
    if mode == "template" and form != "template":
        log.warning("--quantized-prefill template: not every weight is int4 or Inductor could "
                    "not build its template here; prompt rows dequantise + GEMM instead")
    log.info("prompt rows of the quantised weights take the %s form", form)
    return form


def _candidates(weight, rows: int) -> dict[str, Form]:
    if isinstance(weight, torch.Tensor):
        names = ["linear", "pad_linear", "pad_flip"] if rows == 1 else ["linear", "flip"]
        return {name: FORMS[name] for name in names}
    return quant_forms(weight.kind)


def _key(weight) -> tuple:
    kind = weight.dtype if isinstance(weight, torch.Tensor) else weight.kind
    return tuple(weight.shape), kind


class RowAwareLinear:
    """Call as `linear(x, weight, bias)` with an fp tensor or a prepared quantised weight;
    after `calibrate`, each (shape, bucket) uses the fastest measured form. Uncalibrated, it is
    F.linear, or the quantised kind's default form."""

    def __init__(self) -> None:
        # only non-default choices: (shape, bucket) for fp weights, (kind, shape, bucket) else
        self._choice: dict[tuple, str] = {}

    def calibrate(self, groups: list[list], repeats: int = 5,
                  dtype: torch.dtype = torch.float32) -> None:
        """groups: lists of same-shape weights (e.g. every layer's qkv weight); dtype: the
        activations' dtype for quantised weights (fp weights use their own)."""
        for weights in groups:
            weights = [w for w in weights if w.device.type == "cpu" and len(w.shape) == 2]
            if not weights:
                continue
            shape, kind = _key(weights[0])
            x_dtype = kind if isinstance(kind, torch.dtype) else dtype
            for rows in BUCKETS:
                candidates = _candidates(weights[0], rows)
                if len(candidates) < 2:
                    continue
                key = (shape, kind, rows)
                with _lock:
                    if key not in _measured:
                        x = torch.randn(rows, shape[1], dtype=x_dtype)
                        _measured[key] = _fastest(candidates, weights, x, repeats)
                    name = _measured[key]
                if name != next(iter(candidates)):
                    fp = isinstance(kind, torch.dtype)
                    self._choice[(shape, rows) if fp else (kind, shape, rows)] = name
        log.debug("row-aware matmul forms: %s", self._choice)

    def form(self, shape: tuple[int, int], rows: int, kind: str | None = None) -> str:
        """The name of the form used for this weight shape (and quantised kind) and row count."""
        if kind is None:
            if rows > BUCKETS[-1]:
                return "linear"
            return self._choice.get((shape, _bucket(rows)), "linear")
        bucket = _bucket(min(rows, BUCKETS[-1]))
        return self._choice.get((kind, shape, bucket)) or next(iter(quant_forms(kind)))

    def __call__(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(weight, torch.Tensor):
            return self._quantized(x, weight, bias)
        if x.dim() == 2:
            name = self.form(tuple(weight.shape), x.shape[0])
            if name != "linear":
                y = FORMS[name](x, weight)
                return y if bias is None else y + bias
        return F.linear(x, weight, bias)

    def _quantized(self, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        name = self.form(tuple(weight.shape), x2.shape[0], weight.kind)
        y = quant_forms(weight.kind)[name](x2, weight)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], y.shape[-1])
