"""The row-wise work of the decoder layers, compiled by torch.compile (Inductor's C++ on CPU).

Between two attentions a layer runs ~60 small ops (norms, the rotary rotation, splits, SiLU,
residual adds, dtype casts) around four matmuls; eager, each op costs a dispatch and, with two
or more threads, an OpenMP fork and join, which at a few rows is most of the step. Compiled,
one call per layer runs them fused, and the matmuls stay the kernels `RowAwareLinear` uses
(torch's weight-only int8/int4 ops, or F.linear).

The boundary is attention: a compiled call runs layer i's output half (o projection, residual,
norm, MLP) and layer i+1's input half (norm, qkv, rotary) and returns that layer's q, k, v;
storing K/V and attention (paged, decode and prefill rows alike) stay outside. So every row of
every step goes through the same code, whatever the step holds: a sequence's tokens do not
depend on what else was batched with it. (A quantised model's prompt rows have compiled layers
of their own, with `prompt_linear`: still one code per kind of token, whatever the batch.)

One compiled function serves every layer (weights are inputs, so the layers share the graph)
and every engine of a process with the same model shape and dtypes. The row count is dynamic;
warm-up compiles at start-up for one row and for several (0/1 sizes specialise).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch
from torch.fx.experimental import _config as fx_config

from backend_engine.attention.compiled_decode import own_copy
from backend_engine.models.layer_halves import input_half, output_half, rms_norm, traced_linear

log = logging.getLogger("kvgate.engine")


def _between(attn, residual, o_weight, post_norm, gate_up_weight, down_weight,
             next_norm, next_qkv_weight, next_qkv_bias, cos, sin,
             eps: float, heads: int, kv_heads: int, head_dim: int,
             linear: Callable = traced_linear):
    hidden = output_half(attn, residual, o_weight, post_norm, gate_up_weight, down_weight, eps,
                         linear)
    q, k, v = input_half(hidden, next_norm, next_qkv_weight, next_qkv_bias, cos, sin, eps,
                         heads, kv_heads, head_dim, linear)
    return hidden, q, k, v


def _last(attn, residual, o_weight, post_norm, gate_up_weight, down_weight, final_norm,
          eps: float, linear: Callable = traced_linear):
    hidden = output_half(attn, residual, o_weight, post_norm, gate_up_weight, down_weight, eps,
                         linear)
    return rms_norm(hidden, final_norm, eps)


EAGER = {"first": input_half, "between": _between, "last": _last}


def _with_linear(fn: Callable, linear: Callable) -> Callable:
    def entry(*args):
        return fn(*args, linear=linear)
    return entry


class CompiledLayers:
    """The three compiled entry points (first input half, between two attentions, last output
    half + final norm) for one model shape, with one linear (`traced_linear`, or
    `prompt_linear` for a quantised model's prompt rows); `failed` once compiling did not work
    here."""

    def __init__(self, linear: Callable = traced_linear) -> None:
        compile_ = lambda fn: torch.compile(own_copy(_with_linear(own_copy(fn), linear)),
                                            dynamic=False, fullgraph=True)
        self.linear = linear
        self.first = compile_(input_half)
        self.between = compile_(_between)
        self.last = compile_(_last)
        self.failed = False

    def run(self, name: str, args: tuple, rows_at: tuple[int, ...]):
        """The entry point `name` ("first", "between" or "last") on args, with dim 0 (the rows)
        of args[i] for i in rows_at dynamic; eager if it cannot be compiled here."""
        if self.failed:
            return EAGER[name](*args, linear=self.linear)
        fn = getattr(self, name)
        if args[rows_at[0]].shape[0] > 1:  # one row specialises: its own graph
            for i in rows_at:
                torch._dynamo.mark_dynamic(args[i], 0)
        try:
            with fx_config.patch(use_duck_shape=False):
                return fn(*args)
        except Exception as exc:  # noqa: BLE001 - Inductor raises many kinds; eager always works
            self.failed = True
            log.warning("compiled layers are unavailable here (%s: %s); running them eager",
                        type(exc).__name__, str(exc).splitlines()[0][:200])
            return EAGER[name](*args, linear=self.linear)


_lock = threading.Lock()
_shared: dict[tuple, CompiledLayers] = {}


def compiled_layers(key: tuple, linear: Callable = traced_linear) -> CompiledLayers:
    """One CompiledLayers per model shape, dtypes and linear in a process (engines share it)."""
    with _lock:
        if (key, linear) not in _shared:
            _shared[key, linear] = CompiledLayers(linear)
        return _shared[key, linear]
