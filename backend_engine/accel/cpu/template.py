"""The `template` form of int4 prompt rows: Inductor's weight-only int4 GEMM template.

torch's int4 kernel dequantises the weight again for every few rows, so from ~16 rows it is
slower than a GEMM; the `tiles` form (tiles.py) pays a whole-weight dequantisation per call
instead. Inductor lowers the same op, under `max_autotune` and with the weight a constant of the
graph (`freezing`), to a C++ GEMM template whose micro-kernel dequantises a block of the weight
into bf16 once and multiplies it with AMX tiles: the fastest prompt form on `cpu-amx`
(accel/plan.py). Inductor has no such micro-kernel without AVX512; there the build fails, and
prompt rows take the tiles.

The template re-blocks the weight at compile time, so each weight is compiled on its own,
frozen, and the graph holds the re-blocked copy: a second int4 copy of the weight
(`extra_bytes`). Inductor's FX-graph cache key does not cover frozen constants (a second weight
of the same shape got the first one's values from it), so each compile carries a no-op graph
pass whose uuid is a digest of its weight (`weight_key`), which Inductor puts in the key;
AOTAutograd's cache stays off for them.

Row bits: one graph with a dynamic row count gives a row the same bits at any row count and
offset (tested), as prompt rows need (tiles.py says why). One row would specialise into a
static graph with another micro-kernel, so a lone row is padded to two.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import types

import torch
import torch._functorch.config as functorch_config

from backend_engine.accel.compile import Compiled, own_copy
from backend_engine.accel.cpu.attached import Attachments
from backend_engine.accel.cpu.kernels import KERNEL_DTYPE, CpuInt4Weight
from backend_engine.accel.cpu.tiles import GEMM_DTYPE, int4_call, int4_tiled_mm

log = logging.getLogger(__name__)

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
    """x [M, K] (bf16) @ one int4 weight's transpose → bf16 [M, N_padded], compiled; None once
    it has failed to build or run here (from then on: always None)."""

    def __init__(self, w: CpuInt4Weight) -> None:
        options = {**_INDUCTOR, "post_grad_custom_post_pass": weight_key(
            (w.packed, w.scales_and_zeros), str(w.group_size))}

        def patches():  # at its first call, which compiles it
            import torch._inductor.config as inductor_config  # imports triton: see above

            return (inductor_config.patch(options),
                    functorch_config.patch(enable_autograd_cache=False))

        self._fn = Compiled(_Frozen(w).eval(), "an int4 GEMM template", patches=patches,
                            fallback=None)
        self.nbytes = w.packed.nbytes + w.scales_and_zeros.nbytes  # the graph's own copy

    @property
    def failed(self) -> bool:
        return self._fn.failed

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        one = x.shape[0] == 1
        # freezing needs inference mode; the graph's guards want inference tensors (as the
        # engine's steps make) with their rows marked dynamic: others would compile it again
        with torch.inference_mode():
            x = (torch.cat([x, x]) if one else x).to(KERNEL_DTYPE).contiguous()
            if not x.is_inference():
                x = x.clone()
            y = self._fn(x, rows_at=(0,))
        return None if y is None else y[:1] if one else y


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


# the template of each weight that has one, found from its packed tensor (compiled code takes
# the weight's tensors as inputs: one graph for every layer's weights)
_attached: Attachments[TemplateMatmul] = Attachments()


def attach(w: CpuInt4Weight, template: TemplateMatmul) -> None:
    """Route the weight's prompt rows through `template` (`lookup`), for the weight's life."""
    _attached.attach(w, w.packed, template)


def lookup(packed: torch.Tensor) -> TemplateMatmul | None:
    """The template attached to the weight whose packed tensor this is, if any."""
    return _attached.lookup(packed)


def extra_bytes(w) -> int:
    """Bytes the weight's attached template holds (its re-blocked copy), else 0."""
    template = lookup(w.packed) if isinstance(w, CpuInt4Weight) else None
    return template.nbytes if template is not None else 0


def attach_all(weights: list) -> bool:
    """Compile and attach a template to every int4 weight in `weights`: all, or none (False)."""
    built = {}
    for w in weights:
        if id(w) not in built:
            template = compile_for(w)
            if template is None:
                return False
            built[id(w)] = template
    for w in weights:
        attach(w, built[id(w)])
    return True


@torch.library.custom_op("kvgate::int4_template_mm", mutates_args=())
def int4_template_mm(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    """x [M, K] @ the int4 weight's transpose through its attached template, or the dequantised
    weight in tiles where none is attached; one op, so compiled layers call it as it is."""
    template = lookup(packed)
    y = template(x) if template is not None else None
    return y.to(GEMM_DTYPE) if y is not None else int4_tiled_mm(x, packed, scales_and_zeros,
                                                                 group_size)


@int4_template_mm.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
      group_size: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0], dtype=GEMM_DTYPE)


def int4_template(x: torch.Tensor, w: CpuInt4Weight) -> torch.Tensor:
    return int4_call(int4_template_mm, x, w)
