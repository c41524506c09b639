"""The one linear interface: `linear(x, weight, bias)`, whatever the weight's format.

A weight is an fp tensor in the compute dtype, or a quantised weight laid out for its device's
kernels (accel/prepare.py), whose class names its `kind`. What multiplies a quantised weight is a
*form*; a `Linear` holds one form per kind, and the execution plan (accel/plan.py) gives each
kind of row its Linear. The model code only ever calls a Linear, so it has no format branch.

A mixture of experts' grouped matmuls (models/moe.py) may have a form of their own too, the
Linear's `experts`: None runs each active expert through the Linear.

`REFERENCE` is the reference form of every kind: the weight dequantised to the activations'
dtype, then F.linear. It is slow and exact to the stored values; every other form is tested
against it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

Form = Callable[[torch.Tensor, Any], torch.Tensor]  # (x [M, K], weight) → y [M, N]


def reference_form(x: torch.Tensor, weight) -> torch.Tensor:
    return F.linear(x, weight.dequantize(x.dtype))


class Linear:
    """y = x @ W^T (+ bias): F.linear for an fp tensor, else the form held for `weight.kind`."""

    def __init__(self, name: str, forms: Mapping[str, Form],
                 default: Form | None = None, experts: Callable | None = None) -> None:
        self.name = name
        self.forms = dict(forms)
        self.default = default  # the form of kinds not named in `forms` (None: an error)
        self.experts = experts  # (x, top_weights, top_experts, experts, linear) → y, or None

    def __repr__(self) -> str:
        return f"Linear({self.name})"

    def form(self, kind: str) -> Form:
        form = self.forms.get(kind, self.default)
        if form is None:
            raise TypeError(f"{self.name} rows have no form for {kind} weights")
        return form

    def __call__(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return F.linear(x, weight, bias)
        y = self.form(weight.kind)(x.reshape(-1, x.shape[-1]), weight)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], y.shape[-1])


REFERENCE = Linear("reference", {}, default=reference_form)
