"""Prompt rows of int4 CPU weights through Inductor's weight-only int4 GEMM template.

torch's int4 kernel dequantises the weight again for every 4 rows, so from ~16 rows it is slower
than bf16's GEMM; the dequantise-then-GEMM form (cpu_gemm.py) pays a whole-weight dequantisation
per call instead (~3 ms a SmolLM2 layer). Inductor lowers the same op, under `max_autotune`, to a
C++ GEMM template whose micro-kernel dequantises a block of the weight into bf16 and multiplies
it with AMX tiles (on CPUs that have them; AVX512 elsewhere): on the 2-core AMX machine it ran
SmolLM2's gate_up (3072 x 576) at 64 rows in 0.30 ms against the kernel's 1.9, and at 256 rows
in 0.70 against 8.7 (docs/engine/quantization.md has the table).

The template needs the weight as a constant of the compiled graph (it re-blocks it at compile
time), so each weight is compiled on its own, frozen: ~0.4 s a weight with a cold Inductor
cache, ~0.15 s from it, and the graph holds the re-blocked copy, a second int4 copy of the
weight (counted in the weight's `nbytes`). Inductor's FX-graph cache key does not cover frozen
constants: a second weight of the same shape got the first one's values from it (torch 2.13,
measured). So each compile carries a no-op graph pass whose uuid is a digest of its weight,
which Inductor puts in the key; AOTAutograd's cache stays off for them.

Row bits: one graph with a dynamic row count gives a row the same bits at any row count and
offset (tested), as prompt rows need (cpu_gemm.py says why). One row would specialise into a
static graph with another micro-kernel, so a lone row is padded to two.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import types
import weakref

import torch
import torch._functorch.config as functorch_config
from torch.fx.experimental import _config as fx_config

from backend_engine.attention.compiled_decode import own_copy
from backend_engine.quant.cpu import KERNEL_DTYPE, CpuInt4Weight

log = logging.getLogger(__name__)

MIN_ELEMENTS = 1 << 18  # smaller weights' prompt matmuls cost too little to pay the compile
WARM_ROWS = 128  # the row count the graph is compiled at (its blocking is chosen for it)
_INDUCTOR = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP",
             "size_asserts": False, "alignment_asserts": False}


@functools.cache
def _weight_key_class() -> type:
    """Defined at first use: importing torch._inductor imports triton, which must not happen
    before a process (the kernel tests) has chosen triton's interpreter."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class WeightKey(CustomGraphPass):
        """Changes nothing; its uuid, a digest of the tensors, keys Inductor's cache by them."""

        def __init__(self, tensors, label: str) -> None:
            digest = hashlib.blake2b(label.encode(), digest_size=20)
            for t in tensors:
                digest.update(str((t.dtype, tuple(t.shape))).encode())
                digest.update(t.contiguous().view(torch.uint8).numpy())
            self._uuid = digest.hexdigest()

        def __call__(self, graph: torch.fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            return self._uuid

    return WeightKey


def weight_key(tensors, label: str):
    """An Inductor custom post-grad pass that does nothing but key Inductor's FX-graph cache by
    these tensors' values (`post_grad_custom_post_pass`): the key does not cover a frozen
    graph's constants by itself."""
    return _weight_key_class()(tensors, label)


class _Frozen(torch.nn.Module):
    """One weight as buffers, so freezing makes it a constant: new tensor objects over the
    weight's storage (no copy). Not the weight's own: compiling marks its buffers as static
    inputs, and other compiled code taking the weight (the compiled layers, the dequantisation)
    then guarded on each weight's identity and recompiled per layer until it gave up."""

    def __init__(self, w: CpuInt4Weight) -> None:
        super().__init__()
        self.register_buffer("packed", w.packed.detach())
        self.register_buffer("scales_and_zeros", w.scales_and_zeros.detach())
        self.group_size = w.group_size
        # a code object each: Dynamo keeps compiled entries (and counts recompiles) per code
        self.forward = types.MethodType(own_copy(_Frozen.forward), self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size,
                                                         self.scales_and_zeros)


class TemplateMatmul:
    """x [M, K] (bf16) @ one int4 weight's transpose → bf16 [M, N_padded], compiled."""

    def __init__(self, w: CpuInt4Weight) -> None:
        self._fn = torch.compile(_Frozen(w).eval(), dynamic=False, fullgraph=True)
        self._inductor = {**_INDUCTOR, "post_grad_custom_post_pass": weight_key(
            (w.packed, w.scales_and_zeros), str(w.group_size))}
        self.nbytes = w.packed.nbytes + w.scales_and_zeros.nbytes  # the graph's own copy
        self.failed = False
        self.compiled = False

    def _compile_now(self, x: torch.Tensor) -> torch.Tensor:
        """The first call: compile under the template's configuration. Later calls skip these
        patches (~0.1-0.2 ms a call); their inputs (bf16, contiguous, 2+ rows marked dynamic,
        inference mode) pass the graph's guards, so nothing compiles again."""
        import torch._inductor.config as inductor_config  # imports triton: see above

        with inductor_config.patch(self._inductor), \
                functorch_config.patch(enable_autograd_cache=False), \
                fx_config.patch(use_duck_shape=False):
            y = self._fn(x)
        self.compiled = True
        return y

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """None once it has failed to run here (from then on: always None)."""
        if self.failed:
            return None
        one = x.shape[0] == 1
        try:  # freezing needs inference mode; the graph's guards want inference tensors (as
            # the engine's steps make), marked dynamic: others would compile it again
            with torch.inference_mode():
                x = (torch.cat([x, x]) if one else x).to(KERNEL_DTYPE).contiguous()
                if not x.is_inference():
                    x = x.clone()
                torch._dynamo.mark_dynamic(x, 0)
                y = self._fn(x) if self.compiled else self._compile_now(x)
        except Exception as exc:  # noqa: BLE001 - Inductor raises many kinds
            self.failed = True
            log.warning("an int4 GEMM template failed (%s: %s); its prompt rows take the "
                        "dequantise + GEMM form", type(exc).__name__,
                        str(exc).splitlines()[0][:200] if str(exc) else "")
            return None
        return y[:1] if one else y


def eligible(w, min_elements: int = MIN_ELEMENTS) -> bool:
    """An int4 CPU weight with at least `min_elements` (by default: large enough for the
    template to pay its compile)."""
    return (isinstance(w, CpuInt4Weight) and w.device.type == "cpu"
            and w.shape[0] * w.shape[1] >= min_elements)


def compile_for(w: CpuInt4Weight) -> TemplateMatmul | None:
    """The weight's template matmul, compiled now (at `WARM_ROWS` rows) and checked against
    torch's kernel; None where Inductor cannot build it here."""
    template = TemplateMatmul(w)
    x = torch.randn(WARM_ROWS, w.shape[1], generator=torch.Generator().manual_seed(0)).to(
        KERNEL_DTYPE)
    y = template(x)
    if y is None:
        return None
    ref = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.packed, w.group_size,
                                                     w.scales_and_zeros)
    if not torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max()):
        log.warning("the int4 GEMM template disagrees with torch's kernel here; not used")
        return None
    return template


# packed weight's data_ptr → (its CpuInt4Weight, weakly; the template); kept off the weight,
# which compiled code takes as an input (one graph for every layer's weights)
_attached: dict[int, tuple[weakref.ref, TemplateMatmul]] = {}


def attach(w: CpuInt4Weight, template: TemplateMatmul) -> None:
    """Route the weight's prompt rows through `template` (`lookup`), for the weight's life."""
    ptr = w.packed.data_ptr()

    def forget(ref: weakref.ref, ptr: int = ptr) -> None:
        if ptr in _attached and _attached[ptr][0] is ref:
            del _attached[ptr]

    _attached[ptr] = (weakref.ref(w, forget), template)


def lookup(packed: torch.Tensor) -> TemplateMatmul | None:
    """The template attached to the weight whose packed tensor this is, if any."""
    entry = _attached.get(packed.data_ptr())
    return entry[1] if entry is not None and entry[0]() is not None else None


def extra_bytes(w) -> int:
    """Bytes the weight's attached template holds (its re-blocked copy), else 0."""
    template = lookup(w.packed) if isinstance(w, CpuInt4Weight) else None
    return template.nbytes if template is not None else 0
