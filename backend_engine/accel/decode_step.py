"""The decode rows of a step as one compiled graph: every layer, K/V stores and attention
included, from the embedded tokens to the final norm (Inductor's C++ on CPU).

Compiled layers (compiled_layers.py) fuse the row-wise ops between two attentions, but a step
still makes ~60 compiled calls and as many eager attention calls, each with Dynamo's guard
check, argument handling and padding: at one or a few rows that costs more than the quantised
matmuls. Decode rows need none of it: one query each, attention over their blocks
(paged_decode.py, the block-table lookup fused into the reductions), the same shapes in every
layer. So they run as one graph, one call per step; the new K/V rows are written in place into
the paged caches inside it (Inductor mutates the cache tensors, it does not copy them).

The rows of a step's prefill chunks keep the layer-by-layer path: prompt chunks, and decode rows
carrying speculative drafts, need prefill attention. Decode rows always come here, whatever else
the step holds, so a sequence's tokens do not depend on its batch. The row count and the width
of the block tables are dynamic (one row specialises: its own graph); `warm_up` compiles both at
start-up. The graph's wrapper (the code that calls its kernels in turn) is C++ on CPU: Python's
runs ~1,000 statements a step for a 30-layer model. A step that cannot be built here falls back
to the next form (`candidates`), and in the end to the layer-by-layer path.

With `templates` (int8 weights on `cpu-amx`, accel/plan.py): the weights are constants of the
graph instead of its inputs (Inductor's `freezing`), so under `max_autotune` Inductor lowers each
weight-only matmul to its C++ GEMM template, which re-blocks the weight at compile time and
multiplies with AMX tiles, where torch's int8 kernel converts the weight again for every few
rows. The graph holds the re-blocked copy (`extra_bytes`). One graph serves every row count: a
lone row is padded to two (a duplicate, writing the same K/V to the same slot), as one row would
specialise into another graph with another micro-kernel and other bits. Compiling it takes
minutes with a cold Inductor cache; the cache is keyed by the weights' values
(cpu/template.weight_key), which Inductor's own key does not cover for frozen constants.
"""

from __future__ import annotations

import dataclasses
import re
import types

import torch
import torch._functorch.config as functorch_config

from backend_engine.accel.compile import Compiled, own_copy
from backend_engine.accel.cpu.template import weight_key
from backend_engine.accel.paged_decode import paged_decode
from backend_engine.attention.torch_backend import store_kv
from backend_engine.models.layers import input_half, output_half, rms_norm
from backend_engine.models.linear import Linear


def _decode_step(hidden, cos, sin, layers, caches, final_norm, slot_mapping, block_tables,
                 context_lens, eps: float, heads: int, kv_heads: int, head_dim: int,
                 scale: float, linear: Linear):
    """hidden [B, hidden]; layers: per layer (input norm, qkv weight, qkv bias, q/k head
    norms, o weight, post-attention norm, gate/up weight, down weight: DecoderLayer.weights);
    caches: per layer (K, V) pools."""
    for (norm, qkv_weight, qkv_bias, qk_norm, o_weight, post_norm, gate_up_weight,
         down_weight), (k_cache, v_cache) in zip(layers, caches):
        q, k, v = input_half(hidden, norm, qkv_weight, qkv_bias, qk_norm, cos, sin, eps, heads,
                             kv_heads, head_dim, linear)
        store_kv(k, v, k_cache, v_cache, slot_mapping)
        attn = paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
        hidden = output_half(attn, hidden, o_weight, post_norm, gate_up_weight, down_weight,
                             eps, linear)
    return rms_norm(hidden, final_norm, eps)


_FIXED_ARGUMENTS = ("layers", "caches", "final_norm", "self")
# the template graph's compile: weights as constants, matmuls through Inductor's C++ templates
# (its only backend here: with ATen's kernel as a second choice, Inductor would time both for
# every weight, and pick by the warm-up's row count)
TEMPLATE_INDUCTOR = {"freezing": True, "max_autotune": True,
                     "max_autotune_gemm_backends": "CPP"}
_TENSOR = object()  # marks a weight field held as a buffer


def _step_input_guards(entries: list) -> list[bool]:
    """Which of Dynamo's guards to keep: all but those on the weights, norms and KV pools, the
    same objects for a DecodeStep's whole life (~300 tensors, whose checks cost a noticeable
    share of a one-row step). A guard's name starts with its argument's (`layers[3][1]`)."""
    return [re.split(r"[\[.]", entry.name, maxsplit=1)[0] not in _FIXED_ARGUMENTS
            for entry in entries]


def candidates(device: torch.device, templates: bool) -> list[tuple[bool, bool]]:
    """(templates, C++ wrapper) forms of the step to try in turn: the template graph keeps
    Python's wrapper; each falls back to the next if it does not build here."""
    cpu = device.type == "cpu"
    forms = [(True, False)] if templates else []
    forms += [(False, cpu), (False, False)]
    return list(dict.fromkeys(forms))


class TemplateStep(torch.nn.Module):
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
        self.forward = types.MethodType(own_copy(TemplateStep.forward), self)

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


class DecodeStep:
    """The compiled decode step of one model over one engine's KV caches."""

    def __init__(self, layers: tuple, final_norm: torch.Tensor, eps: float, heads: int,
                 kv_heads: int, head_dim: int, scale: float, linear: Linear,
                 templates: bool = False, cpp_wrapper: bool = False) -> None:
        # Inductor's wrapper asserts every input's size and stride at each call (~600 asserts
        # here): the weights and pools are fixed, the step inputs are guarded
        options = {"guard_filter_fn": _step_input_guards, "size_asserts": False,
                   "alignment_asserts": False}
        if cpp_wrapper:  # the kernels apart at -O3, the wrapper at -O1: a shorter build
            options.update(cpp_wrapper=True, cpp_wrapper_build_separate=True)
        self._consts = (eps, heads, kv_heads, head_dim, scale, linear)
        self.templates, self.cpp_wrapper = templates, cpp_wrapper
        self.extra_bytes = 0  # what the graph holds besides the model's weights
        self._layers, self._final_norm = layers, final_norm
        label = ("the decode step with GEMM templates" if templates else
                 "the decode step (C++ wrapper)" if cpp_wrapper else "the decode step")
        if templates:
            # also in the options: a compile without freezing finds no template, and fails
            options.update({k: v for k, v in TEMPLATE_INDUCTOR.items() if k != "freezing"})
            step = TemplateStep(layers, final_norm, self._consts).eval()
            config = {**TEMPLATE_INDUCTOR, "post_grad_custom_post_pass": weight_key(
                list(step.buffers()), "decode-step")}
            self._fn = Compiled(step, label, options=options, fallback=None,
                                patches=lambda: _template_patches(config))
            self.extra_bytes = sum(t.nbytes for t in step.buffers() if t.dtype in (
                torch.int8, torch.uint8))  # the templates' re-blocked copies
        else:
            self._fn = Compiled(_decode_step, label, options=options, fallback=None)
        self._caches: object = None  # the KV caches it was compiled over (warm_up)

    @property
    def failed(self) -> bool:
        return self._fn.failed

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 caches: tuple, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor) -> torch.Tensor | None:
        """The final-normed hidden states of the decode rows (after writing their K/V), or None
        if the graph cannot be compiled here (from then on: always None) or `caches` are not
        the caches it was warmed up over (it does not guard on them: their shapes are baked in)."""
        if self._fn.failed or caches is not self._caches:
            return None
        if block_tables.shape[1] < 2:  # one block would specialise: pad (masked out)
            block_tables = torch.nn.functional.pad(block_tables, (0, 2 - block_tables.shape[1]))
        step = [hidden, cos, sin, slot_mapping, block_tables, context_lens]
        one = hidden.shape[0] == 1
        if one and self.templates:  # the template graph has one form for every row count
            step = [torch.cat([t, t]) for t in step]
        if not one or self.templates:  # one row specialises: its own graph
            for tensor in step:
                torch._dynamo.mark_dynamic(tensor, 0)
        torch._dynamo.mark_dynamic(step[4], 1)
        hidden, cos, sin, slot_mapping, block_tables, context_lens = step
        if self.templates:
            out = self._fn(hidden, cos, sin, caches, slot_mapping, block_tables, context_lens)
            return out if out is None or not one else out[:1]
        return self._fn(hidden, cos, sin, self._layers, caches, self._final_norm, slot_mapping,
                        block_tables, context_lens, *self._consts)

    def warm_up(self, caches: tuple, hidden_size: int, cos_sin) -> bool:
        """Compile now (start-up) for one row and for several. Writes K/V rows of zeros into
        the first slots of the caches, which hold nothing yet. True if it works."""
        dtype, device = self._final_norm.dtype, self._final_norm.device
        self._caches = caches
        with torch.inference_mode():
            for rows in (1, 3):  # inference tensors, as in the engine's steps
                hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
                positions = torch.arange(rows, device=device)
                slots = torch.arange(rows, device=device)
                tables = torch.zeros(rows, 3, dtype=torch.long, device=device)
                lens = torch.arange(1, rows + 1, device=device)
                if self(hidden, *cos_sin(positions), caches, slots, tables, lens) is None:
                    return False
        return True


def _template_patches(config: dict) -> tuple:
    """Freezing is read before torch.compile's options apply; no AOTAutograd cache, whose key
    would not cover the constants either. Later calls pass the guards and compile nothing
    (were anything to, without freezing no template could be built, and the step would fail,
    loudly, rather than change its bits)."""
    import torch._inductor.config as inductor_config  # imports triton: not at import time

    return (inductor_config.patch(config), functorch_config.patch(enable_autograd_cache=False))
