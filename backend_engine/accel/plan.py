"""The execution plan: which code multiplies each weight on each class of device, per kind of row.

Chosen from the device's class and the weights' format alone, never from timings: every replica
on one kind of machine runs the same code and so answers a greedy request the same way, and a
reader finds the code from this table. The replica logs its plan in one line at start-up.

| device class | weights | decode rows | prompt rows | lm_head | compiled |
|---|---|---|---|---|---|
| `cpu-amx`    | fp   | dense    | dense     | dense | yes |
| `cpu-amx`    | int8 | template | tiles     | w8a8  | yes |
| `cpu-amx`    | int4 | kernel   | template  | w8a8  | yes |
| `cpu-avx512` | fp   | dense    | dense     | dense | yes |
| `cpu-avx512` | int8, int4 | kernel | int8_sums | w8a8 | yes |
| `cpu`        | fp   | dense    | dense     | dense | yes |
| `cpu`        | int8, int4 | kernel | tiles | w8a8 | yes |
| `cuda`       | fp   | dense    | dense     | dense | no  |
| `cuda`       | int8, int4 | triton | triton | int8 | no |

Device classes: `cpu-amx`, x86 with AMX tiles (bf16 and int8 GEMMs in hardware);
`cpu-avx512`, x86 with AVX512-VNNI and no AMX (int8 dot products); `cpu`, any other CPU (AVX2
x86, Arm); `cuda`, an NVIDIA GPU. Rows: decode rows are one token of a running sequence; prompt
rows are prompt tokens but each prompt's last (whose logits give the first output token, and
which takes the decode rows' form); the other rows of a step (the last prompt token, drafts to
verify, recomputed tokens) take the decode form too. So which form a token takes depends on its
place in its sequence alone, and a sequence's tokens do not depend on its batch.

Forms (accel/forms.py): `dense` F.linear in the compute dtype; `kernel` torch's weight-only
int8/int4 kernels; `tiles` the weight dequantised (bf16 where the CPU computes it natively, else
fp32), then GEMMs over fixed 64-row tiles (accel/cpu/tiles.py); `template` Inductor's C++ GEMM template with the weight frozen into the
graph (int8 decode rows: the whole decode step's graph, accel/decode_step.py, when every layer
weight is int8; int4 prompt rows: a graph per weight, accel/cpu/template.py); `int8_sums` int8
weights (int4 ones requantised per call) times the activations as two int8 digits, summed
exactly in integers (accel/cpu/int8_sums.py); `w8a8` int8 weights times int8 activations per
row (the lm_head); `triton` the Triton kernels (accel/cuda/); `reference` the weight
dequantised and F.linear — the oracle every other form is tested against, greedy tokens equal
and logprobs within a stated tolerance (tests/backend_engine/accel/). Compiled: the layers'
row-wise ops fused between attentions and decode rows as one graph per step (CPU, one rank).

Attention and a mixture of experts' matmuls take one form per device class: on CPUs `torch`
attention and `grouped` experts (rows grouped by expert, each active expert once through the
Linear, models/moe.py), on CUDA `triton` for both (the paged attention kernels; every expert's
weights stacked and each projection one grouped launch, accel/cuda/fused_moe.py).

Developer overrides (`--engine-option KEY=VALUE`, `EngineConfig.engine_options`): `device_class`,
`decode`, `prompt`, `lm_head`, `compiled` (on/off), `attention` (torch/triton), `experts`
(grouped/triton), and
`prompt_weights` (resident/per_call: whether `tiles` prompt rows keep each weight's dequantised
copy, which by default they do when the model's copies fit a budget of its size alone,
accel/cpu/tiles.py), and
`plan=reference` (every matmul `reference`, eager, torch attention). They change speed, never
answers beyond the stated tolerances.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend_engine.dtype import cpu_flags

DEVICE_CLASSES = ("cpu-amx", "cpu-avx512", "cpu", "cuda")
FORMATS = ("fp", "int8", "int4")
# (decode form, prompt form) per device class and weights' format
TABLE: dict[str, dict[str, tuple[str, str]]] = {
    "cpu-amx": {"fp": ("dense", "dense"), "int8": ("template", "tiles"),
                "int4": ("kernel", "template")},
    "cpu-avx512": {"fp": ("dense", "dense"), "int8": ("kernel", "int8_sums"),
                   "int4": ("kernel", "int8_sums")},
    "cpu": {"fp": ("dense", "dense"), "int8": ("kernel", "tiles"),
            "int4": ("kernel", "tiles")},
    "cuda": {"fp": ("dense", "dense"), "int8": ("triton", "triton"),
             "int4": ("triton", "triton")},
}
# w8a8's integer sums: oneDNN's VNNI kernel, or on the `cpu` class kvgate's AVX2 kernel
# (accel/cpu/native.py); exact either way, so the classes answer alike
LM_HEAD = {"cpu-amx": "w8a8", "cpu-avx512": "w8a8", "cpu": "w8a8", "cuda": "int8"}
# the forms each kind of row may take per format (developer overrides are checked here)
VALID_FORMS = {
    "decode": {"fp": {"dense", "reference"},
               "int8": {"kernel", "template", "reference", "triton"},
               "int4": {"kernel", "reference", "triton"}},
    "prompt": {"fp": {"dense", "reference"},
               "int8": {"kernel", "tiles", "int8_sums", "reference", "triton"},
               "int4": {"kernel", "tiles", "template", "int8_sums", "reference", "triton"}},
}
CPU_ONLY = {"kernel", "tiles", "template", "int8_sums", "w8a8"}
LM_HEAD_FORMATS = ("w8a8", "int8", "int4")
OPTIONS = ("device_class", "decode", "prompt", "lm_head", "compiled", "attention", "experts",
           "prompt_weights", "plan")
PROMPT_WEIGHTS = ("auto", "resident", "per_call")


class PlanError(ValueError):
    """An engine option that names no form, or a form this device or format cannot run."""


def device_class(device: str, cpuinfo: str | None = None) -> str:
    """The class of `device` ("cpu", "cuda", "cuda:1"), from the CPU's feature flags."""
    if device.startswith("cuda"):
        return "cuda"
    flags = cpu_flags(cpuinfo)
    if "amx_tile" in flags and "amx_bf16" in flags:
        return "cpu-amx"
    if "avx512_vnni" in flags:
        return "cpu-avx512"
    return "cpu"


@dataclass(frozen=True, slots=True)
class Plan:
    device_class: str
    decode: dict[str, str]  # weights' format → the form of decode (and other non-prompt) rows
    prompt: dict[str, str]  # weights' format → the form of prompt rows
    lm_head: str  # the lm_head's format when the model is quantised
    compiled: bool
    attention: str  # "torch" | "triton"
    experts: str = "grouped"  # a mixture of experts' matmuls: "grouped" | "triton"
    # `tiles` prompt rows' weights: "resident" (dequantised once, at load), "per_call", or
    # "auto" (resident where the model's dequantised copies fit the budget: accel/forward.py)
    prompt_weights: str = "auto"

    def describe(self, formats: set[str], experts: bool = False) -> str:
        """One line for the start-up log, for the formats the model's layers hold (and its
        experts' form, for a mixture of experts)."""
        weights = "; ".join(f"{f} weights: decode rows {self.decode[f]}, prompt rows "
                            f"{self.prompt[f]}" for f in FORMATS if f in formats)
        lm_head = f", lm_head {self.lm_head}" if formats - {"fp"} else ""
        moe = f", {self.experts} experts" if experts else ""
        if any(self.prompt[f] == "tiles" for f in formats) and self.prompt_weights != "auto":
            weights += f" (tiles weights {self.prompt_weights.replace('_', ' ')})"
        return (f"plan for {self.device_class}: {weights}{lm_head}; "
                f"{'compiled' if self.compiled else 'eager'}, {self.attention} attention{moe}")


def plan_for(device: str, options: dict[str, str] | None = None, *, one_rank: bool = True,
             enforce_eager: bool = False) -> Plan:
    """The plan for `device`, with the developer overrides in `options`. one_rank: the replica
    is not tensor-parallel (compiled pieces run on one rank); enforce_eager: nothing compiled.
    (int8's template decode step freezes every layer into one graph: a model whose layers are
    not all int8 takes the kernel instead; accel/forward.py.)"""
    options = dict(options or {})
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise PlanError(f"unknown engine option(s) {', '.join(sorted(unknown))}; known: "
                        f"{', '.join(OPTIONS)}")
    cls = options.get("device_class") or device_class(device)
    if cls not in DEVICE_CLASSES:
        raise PlanError(f"engine option device_class={cls!r}: choose one of "
                        f"{', '.join(DEVICE_CLASSES)}")
    on_cuda = device.startswith("cuda")
    if (cls == "cuda") != on_cuda:
        raise PlanError(f"engine option device_class={cls}: the device is {device}")
    decode = {f: forms[0] for f, forms in TABLE[cls].items()}
    prompt = {f: forms[1] for f, forms in TABLE[cls].items()}
    compiled = not on_cuda and one_rank and not enforce_eager
    attention = "triton" if on_cuda else "torch"
    experts = "triton" if on_cuda else "grouped"
    lm_head = LM_HEAD[cls]
    if options.get("plan") not in (None, "reference"):
        raise PlanError(f"engine option plan={options['plan']!r}: the only named plan is "
                        "'reference'")
    if options.get("plan") == "reference":
        decode = {f: "reference" for f in FORMATS}
        prompt = dict(decode)
        compiled, attention, experts = False, "torch", "grouped"
    for key, forms in (("decode", decode), ("prompt", prompt)):
        if key in options:
            _override(forms, key, options[key], on_cuda)
    if "lm_head" in options:
        lm_head = _choice("lm_head", options["lm_head"], LM_HEAD_FORMATS)
        if lm_head == "w8a8" and on_cuda:
            raise PlanError("engine option lm_head=w8a8: a CPU form (the GPU's lm_head is "
                            "int8 or int4)")
    if "compiled" in options:
        compiled = _choice("compiled", options["compiled"], ("on", "off")) == "on"
        if compiled and (on_cuda or not one_rank):
            raise PlanError("engine option compiled=on: compiled layers run on a CPU replica "
                            "of one rank")
    if "attention" in options:
        attention = _choice("attention", options["attention"], ("torch", "triton"))
    if "experts" in options:
        experts = _choice("experts", options["experts"], ("grouped", "triton"))
    prompt_weights = _choice("prompt_weights", options.get("prompt_weights", "auto"),
                             PROMPT_WEIGHTS)
    return Plan(cls, decode, prompt, lm_head, compiled, attention, experts, prompt_weights)


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise PlanError(f"engine option {key}={value!r}: choose one of {', '.join(allowed)}")
    return value


def _override(forms: dict[str, str], key: str, value: str, on_cuda: bool) -> None:
    """`decode=FORM` (every quantised format) or `decode=FORMAT:FORM,...`."""
    for item in value.split(","):
        fmt, _, form = item.rpartition(":")
        for f in [fmt] if fmt else ["int8", "int4"]:
            valid = VALID_FORMS[key].get(f, set())
            if form not in valid:
                raise PlanError(f"engine option {key}={value!r}: {key} rows of {f} weights "
                                f"take one of {', '.join(sorted(valid)) or '(no such format)'}")
            if (form in CPU_ONLY and on_cuda) or (form == "triton" and not on_cuda):
                raise PlanError(f"engine option {key}={value!r}: {form} does not run on "
                                f"{'CUDA' if on_cuda else 'CPU'}")
            forms[f] = form
