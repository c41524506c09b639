"""The decode rows of a step as one compiled graph: every layer, K/V stores and attention
included, from the embedded tokens to the final norm (Inductor's C++ on CPU).

Compiled layers (compiled_layers.py) fuse the row-wise ops between two attentions, but a step
still makes ~60 compiled calls and as many eager attention calls, each with Dynamo's guard
check, argument handling and padding: at one or a few rows that costs more than the quantised
matmuls. Decode rows need none of it: one query each, attention over their blocks
(paged_decode.py, the block-table lookup fused into the reductions), the same shapes in every
layer. So they run as one graph, one call per step; the new K/V rows are written in place into
the paged caches inside it. Where KV cache groups share pools (kv_cache_groups.py), a store is
one opaque op that declares the pools it writes (torch_backend.store_kv_op): a pool written by
several layers, traced as plain index_copy_, became a new pool per write, each copied whole but
the last; the op stays one in-place call on the pool itself, however many layers write it. A
pool per layer keeps the plain index_copy_, which Inductor writes in place and fuses.

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
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._functorch.config as functorch_config

from backend_engine.accel.compile import Compiled, own_copy
from backend_engine.accel.cpu.template import weight_key
from backend_engine.accel.paged_decode import paged_decode
from backend_engine.attention.metadata import AttentionMetadata
from backend_engine.attention.torch_backend import store_kv, store_kv_op
from backend_engine.attention.window import decode_window
from backend_engine.models.linear import Linear


def _decode_step(hidden, cos, sin, layers, caches, final_norm, views, eps: float, heads: int,
                 kv_heads: int, head_dim: int, scale: float, linear: Linear,
                 structure: StepStructure):
    """hidden [B, hidden]; layers: per layer its weights (the layer's weights()); caches: the
    distinct (K, V) pools (StepStructure.layers names each layer's); views: per view of the KV
    blocks (StepStructure.views), the decode rows' (slot mapping, block tables, context lens)."""
    store = store_kv_op if structure.shares_pools else store_kv
    for weights, (kind, window, view, page) in zip(layers, structure.layers):
        k_cache, v_cache = caches[page]
        slot_mapping, block_tables, context_lens = views[view]

        def attend(q, k, v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
                   block_tables=block_tables, context_lens=context_lens, window=window):
            store(k, v, k_cache, v_cache, slot_mapping)
            return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, window)

        layer_cos, layer_sin = (cos, sin) if kind is None else (cos[:, kind], sin[:, kind])
        hidden = structure.layer(hidden, layer_cos, layer_sin, weights, attend, eps, heads,
                                 kv_heads, head_dim, linear)
    return structure.norm(hidden, final_norm, eps)


@dataclass(frozen=True)
class StepStructure:
    """What the step's graph bakes in besides shapes: the family's layer and final norm
    (LlamaModel.decode_layer, norm_fn) and, per layer, (its rotary kind or None, its window,
    the view of the KV blocks its attention reads, its KV pools among the distinct ones). A
    view is (KV cache group, window): the group's slot mapping and block tables, these cut to
    the window for a sliding layer (attention/window.py). KV cache groups share pools
    (kv_cache_groups.py): the graph takes each pool once."""
    layer: Callable
    norm: Callable
    layers: tuple[tuple[int | None, int, int, int], ...]
    views: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, model, layer_groups: list[int] | None, kv_caches) -> StepStructure:
        groups = layer_groups or [0] * len(model.layers)
        keys = [(g, layer.window) for g, layer in zip(groups, model.layers)]
        views = tuple(dict.fromkeys(keys))
        pools = list(dict.fromkeys(id(k) for k, _ in kv_caches))
        return cls(model.decode_layer, model.norm_fn,
                   tuple((layer.kind, layer.window, views.index(key), pools.index(id(k)))
                         for layer, key, (k, _) in zip(model.layers, keys, kv_caches)), views)

    @property
    def shares_pools(self) -> bool:
        """Whether some pool serves several layers (KV cache groups): their stores take the op
        that writes in place (torch_backend.store_kv_op); a pool per layer takes plain
        index_copy_, which Inductor writes in place itself, without the op's call."""
        return len({page for *_, page in self.layers}) < len(self.layers)

    @staticmethod
    def pools(kv_caches) -> tuple:
        """The distinct (K, V) pools of the layers' caches, in the order `of` numbers them."""
        return tuple({id(k): (k, v) for k, v in kv_caches}.values())

    def step_views(self, meta: AttentionMetadata, block_size: int) -> list[tuple]:
        """The decode rows' (slot mapping, block tables, context lens) per view, from the
        step's metadata."""
        out, seen = [], set()
        for group, window in self.views:
            part = meta.group_metas[group] if meta.group_metas else meta
            tables, lens = part.decode_block_tables, part.decode_context_lens
            if window:
                tables, lens = decode_window(tables, lens, window, block_size)
            view = []
            for t in (part.slot_mapping[:meta.num_decode_tokens], tables, lens):
                # never one tensor object in two views (a window that cuts nothing returns its
                # input): Dynamo guards against a tensor passed twice, so an alias the warm-up
                # did not have would compile the step again while serving
                view.append(t[:] if id(t) in seen else t)
                seen.add(id(t))
            out.append(tuple(view))
        return out


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

    def forward(self, hidden, cos, sin, caches, views):
        layers = [tuple(self._get(spec) for spec in layer) for layer in self._specs]
        return _decode_step(hidden, cos, sin, layers, caches, self._get(self._final), views,
                            *self._consts)


class DecodeStep:
    """The compiled decode step of one model over one engine's KV caches."""

    def __init__(self, layers: tuple, final_norm: torch.Tensor, eps: float, heads: int,
                 kv_heads: int, head_dim: int, scale: float, linear: Linear,
                 structure: StepStructure, templates: bool = False,
                 cpp_wrapper: bool = False) -> None:
        # Inductor's wrapper asserts every input's size and stride at each call (~600 asserts
        # here): the weights and pools are fixed, the step inputs are guarded
        options = {"guard_filter_fn": _step_input_guards, "size_asserts": False,
                   "alignment_asserts": False}
        if cpp_wrapper:  # the kernels apart at -O3, the wrapper at -O1: a shorter build
            options.update(cpp_wrapper=True, cpp_wrapper_build_separate=True)
        self._consts = (eps, heads, kv_heads, head_dim, scale, linear, structure)
        self.structure = structure
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
        self._pools: tuple = ()  # their distinct (K, V) pools

    @property
    def failed(self) -> bool:
        return self._fn.failed

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 caches: tuple, views: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                 ) -> torch.Tensor | None:
        """The final-normed hidden states of the decode rows (after writing their K/V), or None
        if the graph cannot be compiled here (from then on: always None) or `caches` are not
        the caches it was warmed up over (it does not guard on them: their shapes are baked in).
        views: per view (StepStructure.step_views), the rows' (slot mapping, block tables,
        context lens)."""
        if self._fn.failed or caches is not self._caches:
            return None
        pools = self._pools
        # one block would specialise: pad (masked out)
        views = [(slots, t if t.shape[1] >= 2 else torch.nn.functional.pad(t, (0, 2 - t.shape[1])),
                  lens) for slots, t, lens in views]
        step = [hidden, cos, sin, *(t for view in views for t in view)]
        one = hidden.shape[0] == 1
        if one and self.templates:  # the template graph has one form for every row count
            step = [torch.cat([t, t]) for t in step]
        if not one or self.templates:  # one row specialises: its own graph
            for tensor in step:
                torch._dynamo.mark_dynamic(tensor, 0)
        for block_tables in step[4::3]:
            torch._dynamo.mark_dynamic(block_tables, 1)
        hidden, cos, sin = step[:3]
        views = list(zip(step[3::3], step[4::3], step[5::3]))
        if self.templates:
            out = self._fn(hidden, cos, sin, pools, views)
            return out if out is None or not one else out[:1]
        return self._fn(hidden, cos, sin, self._layers, pools, self._final_norm, views,
                        *self._consts)

    def warm_up(self, caches: tuple, hidden_size: int, cos_sin, dtype: torch.dtype) -> bool:
        """Compile now (start-up) for one row and for several, over hidden states of the
        model's compute `dtype` (its norms may be kept in another: Gemma's in fp32). Writes K/V
        rows of zeros into the first slots of the caches, which hold nothing yet. True if it
        works."""
        device = self._final_norm.device
        self._caches, self._pools = caches, StepStructure.pools(caches)
        with torch.inference_mode():
            for rows in (1, 3):  # inference tensors, as in the engine's steps
                hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
                positions = torch.arange(rows, device=device)
                views = [(torch.arange(rows, device=device),
                          torch.zeros(rows, 3, dtype=torch.long, device=device),
                          torch.arange(1, rows + 1, device=device))
                         for _ in self.structure.views]
                if self(hidden, *cos_sin(positions), caches, views) is None:
                    return False
        return True


def _template_patches(config: dict) -> tuple:
    """Freezing is read before torch.compile's options apply; no AOTAutograd cache, whose key
    would not cover the constants either. Later calls pass the guards and compile nothing
    (were anything to, without freezing no template could be built, and the step would fail,
    loudly, rather than change its bits)."""
    import torch._inductor.config as inductor_config  # imports triton: not at import time

    return (inductor_config.patch(config), functorch_config.patch(enable_autograd_cache=False))
