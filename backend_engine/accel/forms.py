"""The forms the plan names (accel/plan.py), as functions per prepared weight kind, and the
`Linear` a kind of row runs with."""

from __future__ import annotations

import functools

from backend_engine.models.linear import Form, Linear, reference_form

CPU_KINDS = {"int8_cpu": "int8", "int4_cpu": "int4"}
CUDA_KINDS = {"int8_triton": "int8", "int4_triton": "int4"}


def _cpu_functions() -> dict[tuple[str, str], Form]:
    from backend_engine.accel.cpu import int8_sums, kernels, template, tiles

    return {("kernel", "int8_cpu"): kernels.int8_mm, ("kernel", "int4_cpu"): kernels.int4_mm,
            # int8's template is the kernel's op, which the decode step's frozen graph lowers
            ("template", "int8_cpu"): kernels.int8_mm,
            ("template", "int4_cpu"): template.int4_template,
            ("tiles", "int8_cpu"): tiles.int8_tiles, ("tiles", "int4_cpu"): tiles.int4_tiles,
            ("int8_sums", "int8_cpu"): int8_sums.int8_weight_sums,
            ("int8_sums", "int4_cpu"): int8_sums.int4_weight_sums,
            ("w8a8", "w8a8_cpu"): kernels.w8a8_mm}


def _cuda_functions() -> dict[tuple[str, str], Form]:
    from backend_engine.accel.cuda import weights  # triton: only where a GPU runs the model

    return {("triton", "int8_triton"): weights.int8_mm,
            ("triton", "int4_triton"): weights.int4_mm}


def _experts_form(experts: str):
    if experts != "triton":
        return None  # models/moe.py's grouped experts, through the Linear
    from backend_engine.accel.cuda import fused_moe  # triton: only where it runs

    return fused_moe.fused_experts


@functools.cache
def linear(row: str, forms: tuple[tuple[str, str], ...], cuda: bool,
           experts: str = "grouped") -> Linear:
    """The Linear of one kind of row: `forms` is (format, form) pairs from the plan, `experts`
    the plan's form for a mixture of experts. One object per plan and row kind in a process,
    since compiled layers are kept per Linear."""
    by_format = dict(forms)
    if all(form in ("dense", "reference") for form in by_format.values()):
        # no fast form to look up
        return Linear(row, {}, default=reference_form, experts=_experts_form(experts))
    functions = _cuda_functions() if cuda else _cpu_functions()
    kinds = dict(CUDA_KINDS if cuda else CPU_KINDS)
    if not cuda:
        kinds["w8a8_cpu"] = "int8"  # the lm_head: its one form, unless int8 is the reference
    chosen = {}
    for kind, fmt in kinds.items():
        form = "w8a8" if kind == "w8a8_cpu" and by_format[fmt] != "reference" else by_format[fmt]
        chosen[kind] = reference_form if form == "reference" else functions[form, kind]
    return Linear(row, chosen, experts=_experts_form(experts))
