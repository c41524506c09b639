"""The one compile-or-eager helper: a function under torch.compile (Inductor's C++ on CPU), and
what runs when Inductor cannot build it here.

Every compiled piece of the engine (the layers' row-wise halves, the decode step, the CPU
quantised forms' conversions, int4's GEMM templates) goes through `Compiled`, so they share one
set of rules:
- a code object of its own per compiled function (Dynamo keeps compiled entries, and counts
  recompiles against its limit, per code object; one process may run many engines);
- no duck sizing (sizes that happen to be equal at compile time stay separate symbols);
- the rows a caller marks dynamic (dim 0 of the named arguments) when there are two or more:
  one row specialises into a graph of its own, as Inductor does for 0/1 sizes;
- the first failure logs one warning and from then on every call takes the fallback (the
  function itself, eager, unless another is given; `None` makes the call return None so that
  its caller takes its own path). Compiling never changes which code a later call runs except
  by failing, and a failure is loud.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import types
from collections.abc import Callable, Iterable

import torch
from torch.fx.experimental import _config as fx_config

log = logging.getLogger("kvgate.engine")
_EAGER = object()  # the default fallback: the function itself


def own_copy(fn: types.FunctionType) -> types.FunctionType:
    """fn with a code object of its own (Dynamo keys its cache and recompile limit by code)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


class Compiled:
    """`fn` compiled (fullgraph, static shapes but the rows marked at each call), thread-safe.

    per_shape: a graph of its own for every shape of the arguments (compiled on first use);
    dynamic: torch.compile(dynamic=True), one graph for all shapes; options: Inductor options;
    patches: context managers entered around a graph's first call, which compiles it (config
    read at compile time; later calls pass the graph's guards and compile nothing);
    fallback: what runs once compiling failed (default fn eager; None: return None)."""

    def __init__(self, fn: Callable, label: str, *, per_shape: bool = False,
                 dynamic: bool = False, options: dict | None = None,
                 patches: Callable[[], Iterable] | None = None,
                 fallback: Callable | None | object = _EAGER) -> None:
        self.fn, self.label = fn, label
        self._per_shape, self._dynamic, self._options = per_shape, dynamic, options
        self._patches = patches
        self._fallback = fn if fallback is _EAGER else fallback
        self._graphs: dict[tuple, Callable] = {}
        self._ran: set[tuple] = set()  # graphs that have been called (compiled) once
        self._lock = threading.Lock()
        self.failed = False

    def _graph(self, key: tuple) -> Callable:
        with self._lock:
            if key not in self._graphs:
                fn = self.fn if isinstance(self.fn, torch.nn.Module) else own_copy(self.fn)
                self._graphs[key] = torch.compile(fn, dynamic=self._dynamic, fullgraph=True,
                                                  options=self._options)
            return self._graphs[key]

    def __call__(self, *args, rows_at: tuple[int, ...] = ()):
        if self.failed:
            return None if self._fallback is None else self._fallback(*args)
        if rows_at and args[rows_at[0]].shape[0] > 1:
            for i in rows_at:
                torch._dynamo.mark_dynamic(args[i], 0)
        key = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a
                    for a in args) if self._per_shape else ()
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(fx_config.patch(use_duck_shape=False))
                if self._patches is not None and key not in self._ran:
                    for patch in self._patches():
                        stack.enter_context(patch)
                out = self._graph(key)(*args)
            self._ran.add(key)
            return out
        except Exception as exc:  # noqa: BLE001 - Inductor raises many kinds; eager always works
            self.failed = True
            log.warning("%s cannot be compiled here (%s: %s); %s", self.label,
                        type(exc).__name__, (str(exc).splitlines() or [""])[0][:200],
                        "running it eager" if self._fallback is self.fn else
                        "taking the next path" if self._fallback is None else "falling back")
            return None if self._fallback is None else self._fallback(*args)
