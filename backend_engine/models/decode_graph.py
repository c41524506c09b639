"""The decode rows of a step as one compiled graph: every layer, K/V stores and attention
included, from the embedded tokens to the final norm (torch.compile, Inductor's C++ on CPU).

Compiled layers (compiled_layers.py) fuse the row-wise ops between two attentions, but a step
still makes ~60 compiled calls (two per layer) and as many eager attention calls, each with
Dynamo's guard check, argument handling and padding: at one or a few rows that costs more than
the int4 matmuls. Decode rows need none of it: one query each, attention over their blocks
(compiled_decode.paged_decode, the block-table lookup fused into the reductions), the same
shapes in every layer. So they run as one graph, one call per step; the new K/V rows are
written in place into the paged caches inside it (Inductor mutates the cache tensors, it does
not copy them).

The rows of a step's prefill chunks keep the layer-by-layer path (llama.py): prompt chunks,
and decode rows carrying speculative drafts, need prefill attention. Decode rows always come
here, whatever else the step holds, so a sequence's tokens do not depend on its batch. The
row count and the width of the block tables are dynamic (one row specialises: its own graph);
`warm_up` compiles both at start-up; a failure leaves the layer-by-layer path in charge. On
CPU the graph's wrapper is C++ (use_cpp_wrapper), falling back to Python's if it will not build.

Frozen (`--quantized-decode template`, the default for int8 weights on AMX CPUs): the weights
are constants of the graph instead of its inputs (Inductor's `freezing`), so under
`max_autotune` Inductor lowers each weight-only matmul to its C++ GEMM template, which re-blocks
the weight at compile time and multiplies with AMX tiles. torch's int8 kernel converts the
weight again for every 4 rows; at 16 rows the template ran SmolLM2's layers ~1.8x faster and a
16-sequence int8 engine's decode ~2x faster, at one row (padded to two, below) ~10 % slower.
The graph holds the re-blocked copy (one more int8 copy of the layers). One graph serves every
row count: a lone row is padded to two (a duplicate, writing the same K/V to the same slot), as
one row would specialise into another graph with another micro-kernel and other bits. Compiling
it takes minutes with a cold Inductor cache (~4 for SmolLM2 on 2 cores), ~50 s from it; the
cache is keyed by the weights' values (quant/cpu_template.weight_key), which Inductor's own key
does not cover for frozen constants.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import types

import torch
import torch._functorch.config as functorch_config
from torch.fx.experimental import _config as fx_config

from backend_engine.attention.compiled_decode import own_copy, paged_decode
from backend_engine.attention.torch_backend import store_kv
from backend_engine.models.layer_halves import input_half, output_half, rms_norm
from backend_engine.quant.cpu_template import weight_key

log = logging.getLogger("kvgate.engine")


def _decode_step(hidden, cos, sin, layers, caches, final_norm, slot_mapping, block_tables,
                 context_lens, eps: float, heads: int, kv_heads: int, head_dim: int,
                 scale: float):
    """hidden [B, hidden]; layers: per layer (input norm, qkv weight, qkv bias, o weight,
    post-attention norm, gate/up weight, down weight); caches: per layer (K, V) pools."""
    for (norm, qkv_weight, qkv_bias, o_weight, post_norm, gate_up_weight, down_weight), \
            (k_cache, v_cache) in zip(layers, caches):
        q, k, v = input_half(hidden, norm, qkv_weight, qkv_bias, cos, sin, eps, heads,
                             kv_heads, head_dim)
        store_kv(k, v, k_cache, v_cache, slot_mapping)
        attn = paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
        hidden = output_half(attn, hidden, o_weight, post_norm, gate_up_weight, down_weight,
                             eps)
    return rms_norm(hidden, final_norm, eps)


_FIXED_ARGUMENTS = ("layers", "caches", "final_norm", "self")
# the frozen graph's compile: weights as constants, matmuls through Inductor's C++ templates
# (its only backend here: with ATen's kernel as a second choice, Inductor would time both
# for every weight, and pick by the warm-up's row count)
FROZEN_INDUCTOR = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}
_TENSOR = object()  # marks a weight field held as a buffer


def _step_input_guards(entries: list) -> list[bool]:
    """Which of Dynamo's guards to keep: all but those on the weights, norms and KV pools,
    the same objects for a DecodeGraph's whole life (~300 tensors, whose checks took ~0.35 ms
    a step: a twentieth of a one-row int4 step). A guard's name starts with its argument's
    (`layers[3][1]`, `caches[0][0]`)."""
    return [re.split(r"[\[.]", entry.name, maxsplit=1)[0] not in _FIXED_ARGUMENTS
            for entry in entries]


def use_frozen(mode: str, layers: tuple) -> bool:
    """`--quantized-decode`: template → freeze wherever the layers' matmuls are quantised CPU
    weights; auto → only int8 weight-only ones, each at least cpu_template.MIN_ELEMENTS, on a
    CPU with AMX (where it was measured; int4's template lost to torch's kernel at a few rows,
    which int4's one-sequence decode is judged by); kernel, int8 (integer sums) → never."""
    from backend_engine.dtype import cpu_has_amx
    from backend_engine.quant import cpu, cpu_template

    weights = [w for layer in layers for w in (layer[1], layer[3], layer[5], layer[6])]
    if mode in ("kernel", "int8") or not all(
            isinstance(w, (cpu.CpuInt8Weight, cpu.CpuInt4Weight))
            and not isinstance(w, cpu.CpuInt8SumsWeight) and w.device.type == "cpu"
            for w in weights):
        return False
    if mode == "template":
        return True
    return cpu_has_amx() and all(isinstance(w, cpu.CpuInt8Weight) and w.shape[0] * w.shape[1]
                                 >= cpu_template.MIN_ELEMENTS for w in weights)


def use_cpp_wrapper(device: torch.device, frozen: bool) -> bool:
    """Whether the graph's wrapper (the code that calls its kernels and matmuls in turn) is
    C++ rather than Python: on CPU, for the unfrozen graph. Python's wrapper runs ~1,000
    statements a step for a 30-layer model (buffer views, kernel calls, the int4 matmul's op
    dispatch); in C++ a one-row int4 SmolLM2 step took 11.0 against 12.7 ms (interleaved, same
    tokens, 2 cores, no AMX). Its cost is a compile: ~35 s more for SmolLM2's two graphs with
    an empty Inductor cache (the wrapper at -O1, the kernels apart at -O3:
    `cpp_wrapper_build_separate`), nothing from the cache. The frozen graph keeps Python's
    (not measured with its GEMM templates)."""
    return device.type == "cpu" and not frozen


class FrozenStep(torch.nn.Module):
    """`_decode_step` over weights held as buffers, which freezing makes constants. A quantised
    weight (a dataclass of tensors and settings) is rebuilt inside the graph from its buffers,
    so the matmul forms see the weight they always see."""

    def __init__(self, layers: tuple, final_norm: torch.Tensor, consts: tuple) -> None:
        super().__init__()
        self._consts = consts
        self._specs = [tuple(self._hold(f"l{i}_{j}", w) for j, w in enumerate(layer))
                       for i, layer in enumerate(layers)]
        self._final = self._hold("final", final_norm)
        # a code object of its own: Dynamo keeps compiled entries per code object
        self.forward = types.MethodType(own_copy(FrozenStep.forward), self)

    def _hold(self, name: str, w):
        """How to get `w` back in forward: None, a buffer's name, or (class, fields)."""
        if w is None or isinstance(w, torch.Tensor):
            if w is not None:
                self.register_buffer(name, w.detach())
            return None if w is None else name
        fields = []
        for field in dataclasses.fields(w):
            value = getattr(w, field.name)
            if isinstance(value, torch.Tensor):
                self.register_buffer(f"{name}_{field.name}", value.detach())
                fields.append((field.name, _TENSOR))
            else:
                fields.append((field.name, value))
        return type(w), name, tuple(fields)

    def _get(self, spec):
        if spec is None or isinstance(spec, str):
            return None if spec is None else getattr(self, spec)
        cls, name, fields = spec
        return cls(**{field: getattr(self, f"{name}_{field}") if value is _TENSOR else value
                      for field, value in fields})

    def forward(self, hidden, cos, sin, caches, slot_mapping, block_tables, context_lens):
        layers = [tuple(self._get(spec) for spec in layer) for layer in self._specs]
        return _decode_step(hidden, cos, sin, layers, caches, self._get(self._final),
                            slot_mapping, block_tables, context_lens, *self._consts)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.buffers())


class DecodeGraph:
    """The compiled decode step of one model over one engine's KV caches."""

    def __init__(self, layers: tuple, final_norm: torch.Tensor, eps: float, heads: int,
                 kv_heads: int, head_dim: int, scale: float, frozen: bool = False,
                 cpp_wrapper: bool = False) -> None:
        # Inductor's wrapper asserts every input's size and stride at each call (~600 asserts
        # here, ~0.4 ms a step): the weights and pools are fixed, the step inputs are guarded
        options = {"guard_filter_fn": _step_input_guards, "size_asserts": False,
                   "alignment_asserts": False}
        if cpp_wrapper:  # see use_cpp_wrapper
            options.update(cpp_wrapper=True, cpp_wrapper_build_separate=True)
        if frozen:  # also here: a compile without freezing then finds no template, and fails
            options.update({k: v for k, v in FROZEN_INDUCTOR.items() if k != "freezing"})
        self._consts = (eps, heads, kv_heads, head_dim, scale)
        self.frozen, self.cpp_wrapper = frozen, cpp_wrapper
        self.extra_bytes = 0  # what the graph holds besides the model's weights
        if frozen:
            step = FrozenStep(layers, final_norm, self._consts).eval()
            self._fn = torch.compile(step, dynamic=False, fullgraph=True, options=options)
            self._compile_config = {**FROZEN_INDUCTOR, "post_grad_custom_post_pass": weight_key(
                step.tensors(), "decode-step")}
            self.extra_bytes = sum(t.nbytes for t in step.tensors() if t.dtype in (
                torch.int8, torch.uint8))  # the templates' re-blocked copies
        else:
            self._fn = torch.compile(own_copy(_decode_step), dynamic=False, fullgraph=True,
                                     options=options)
        self._layers, self._final_norm = layers, final_norm
        self._caches: object = None  # the KV caches it was compiled over (warm_up)
        self.failed = False

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 caches: tuple, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor) -> torch.Tensor | None:
        """The final-normed hidden states of the decode rows (after writing their K/V), or None
        if the graph cannot be compiled here (from then on: always None) or `caches` are not
        the caches it was warmed up over (it does not guard on them: their shapes are baked in)."""
        if self.failed or caches is not self._caches:
            return None
        if block_tables.shape[1] < 2:  # one block would specialise: pad (masked out)
            block_tables = torch.nn.functional.pad(block_tables, (0, 2 - block_tables.shape[1]))
        step = [hidden, cos, sin, slot_mapping, block_tables, context_lens]
        one = hidden.shape[0] == 1
        if one and self.frozen:  # the frozen graph has one form for every row count
            step = [torch.cat([t, t]) for t in step]
        if not one or self.frozen:  # one row specialises: its own graph
            for tensor in step:
                torch._dynamo.mark_dynamic(tensor, 0)
        torch._dynamo.mark_dynamic(step[4], 1)
        hidden, cos, sin, slot_mapping, block_tables, context_lens = step
        try:
            with fx_config.patch(use_duck_shape=False):
                if self.frozen:
                    out = self._fn(hidden, cos, sin, caches, slot_mapping, block_tables,
                                   context_lens)
                    return out[:1] if one else out
                return self._fn(hidden, cos, sin, self._layers, caches, self._final_norm,
                                slot_mapping, block_tables, context_lens, *self._consts)
        except Exception as exc:  # noqa: BLE001 - Inductor raises many kinds; eager always works
            self.failed = True
            log.warning("the compiled decode step%s is unavailable here (%s: %s); running "
                        "decode rows %s", " (frozen weights)" if self.frozen else
                        " (C++ wrapper)" if self.cpp_wrapper else "",
                        type(exc).__name__, str(exc).splitlines()[0][:200],
                        "with the kernels" if self.frozen else "with a Python wrapper"
                        if self.cpp_wrapper else "layer by layer")
            return None

    def warm_up(self, caches: tuple, hidden_size: int, cos_sin) -> bool:
        """Compile now (start-up) for one row and for several. Writes K/V rows of zeros into
        the first slots of the caches, which hold nothing yet. True if it works."""
        dtype, device = self._final_norm.dtype, self._final_norm.device
        self._caches = caches
        if self.frozen:
            import torch._inductor.config as inductor_config  # imports triton: not at import

            # freezing is read before torch.compile's options apply; no AOTAutograd cache,
            # whose key would not cover the constants either. Later calls pass the guards:
            # nothing compiles again (were anything to, without freezing no template could be
            # built, and the graph would fail, loudly, rather than change its bits)
            config = (inductor_config.patch(self._compile_config),
                      functorch_config.patch(enable_autograd_cache=False))
            log.info("compiling the decode step with its weights frozen into Inductor's GEMM "
                     "templates (--quantized-decode): minutes with a cold Inductor cache")
        else:
            config = ()
        with torch.inference_mode(), contextlib.ExitStack() as stack:
            for entry in config:
                stack.enter_context(entry)
            for rows in (1, 3):  # inference tensors, as in the engine's steps
                hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
                positions = torch.arange(rows, device=device)
                slots = torch.arange(rows, device=device)
                tables = torch.zeros(rows, 3, dtype=torch.long, device=device)
                lens = torch.arange(1, rows + 1, device=device)
                if self(hidden, *cos_sin(positions), caches, slots, tables, lens) is None:
                    return False
        return True
