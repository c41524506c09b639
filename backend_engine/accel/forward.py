"""A model's forward pass as the plan (plan.py) runs it: each kind of row with its Linear, the
layers compiled or eager, decode rows as one compiled graph.

    decode rows ─▶ the decode step (one graph; decode_step.py), else the layers
    prompt rows ─▶ the layers with the prompt Linear        (only where its forms differ)
    other rows  ─▶ the layers with the decode Linear        (last prompt tokens, drafts, ...)

A step holding prompt rows and other rows of one chunk runs the prompt rows first (the others'
attention reads their K/V). Which path a row takes depends on its place in its sequence alone,
so a sequence's tokens do not depend on its batch. Where the plan compiles nothing and prompt
rows take the decode form, this is the model's reference forward with the plan's Linear.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from backend_engine.accel import forms
from backend_engine.accel.compiled_layers import CompiledLayers, compiled_layers
from backend_engine.accel.decode_step import DecodeStep, StepStructure, candidates
from backend_engine.accel.plan import Plan
from backend_engine.attention.metadata import AttentionMetadata
from backend_engine.models.linear import Linear

log = logging.getLogger("kvgate.engine")
_FORMAT_OF_KIND = {**forms.CPU_KINDS, **forms.CUDA_KINDS}
PROMPT_KIND_FORMS = ("tiles", "template", "int8_sums")  # read torch's int4 layout back


def weight_formats(model) -> set[str]:
    """The formats of the model's layer weights: fp, int8, int4."""
    return {"fp" if isinstance(w, torch.Tensor) else _FORMAT_OF_KIND[w.kind]
            for w in model.linear_weights()}


class PlannedForward:
    """The plan's forward pass over one model and one engine's KV caches."""

    def __init__(self, model, plan: Plan, kv_caches,
                 layer_groups: list[int] | None = None) -> None:
        """layer_groups: each layer's KV cache group (None: one group)."""
        self.model = model
        self.formats = weight_formats(model)
        self.notes: list[str] = []
        cuda = model.device.type == "cuda"
        decode = dict(plan.decode)
        if decode["int8"] == "template" and self.formats != {"int8"}:
            decode["int8"] = "kernel"  # the template step freezes every layer: all int8 or none
        prompt = self._checked_prompt(plan, decode)
        compiled = plan.compiled and (model.compiles or model.decode_layer is not None)
        if plan.compiled and not model.compiles:
            rows = "prompt rows' layers" if compiled else "layers"
            self.notes.append(f"{type(model).__name__} {rows} eager: the compiled layers "
                              "trace the Llama layer")
        self.plan = dataclasses.replace(plan, decode=decode, prompt=prompt, compiled=compiled,
                                        prompt_weights=self._resident_tiles(plan, prompt))
        self.linear = forms.linear("decode", tuple(sorted(decode.items())), cuda, plan.experts)
        separate = any(prompt[f] != decode[f] for f in self.formats)
        self.prompt_linear: Linear | None = (
            forms.linear("prompt", tuple(sorted(prompt.items())), cuda, plan.experts)
            if separate else None)
        self.layers: dict[Linear, CompiledLayers | None] = {self.linear: None}
        if self.prompt_linear is not None:
            self.layers[self.prompt_linear] = None
        self.decode_step: DecodeStep | None = None
        if compiled:
            self._compile(kv_caches, decode, layer_groups)

    def _checked_prompt(self, plan: Plan, decode: dict[str, str]) -> dict[str, str]:
        """The plan's prompt forms where they run here; int4 ones read torch's packed layout
        back, which a torch release could change (then int4 prompt rows take the kernel)."""
        prompt = dict(plan.prompt)
        if "int4" in self.formats and prompt["int4"] in PROMPT_KIND_FORMS:
            from backend_engine.accel.cpu import template, tiles

            if not tiles.int4_layout_checked():
                log.warning("this torch lays int4 weights out otherwise: int4 prompt rows "
                            "take the kernel")
                prompt["int4"] = decode["int4"]
            elif prompt["int4"] == "template":
                started = time.perf_counter()
                weights = [w for w in self.model.linear_weights()
                           if getattr(w, "kind", None) == "int4_cpu"]
                if template.attach_all(weights):
                    log.info("int4 GEMM templates compiled in %.1f s",
                             time.perf_counter() - started)
                else:
                    self.notes.append("int4 prompt templates unavailable here: tiles")
        return prompt

    def _resident_tiles(self, plan: Plan, prompt: dict[str, str]) -> str:
        """Keep the dequantised copies of the weights whose prompt rows take `tiles` where the
        plan says so, or by default where they fit the budget (the model's size alone: every
        replica of a model on one class decides alike); the plan's answer."""
        tiled = {kind for kind, f in forms.CPU_KINDS.items()
                 if f in self.formats and prompt[f] == "tiles"}
        weights = [w for w in self.model.linear_weights() if getattr(w, "kind", None) in tiled]
        if not weights or plan.prompt_weights == "per_call":
            return plan.prompt_weights
        from backend_engine.accel.cpu import tiles

        size = tiles.resident_bytes(weights)
        if plan.prompt_weights == "auto" and size > tiles.RESIDENT_BUDGET_BYTES:
            log.info("tiles prompt weights dequantised per call: their copies would take %.0f MiB"
                     " (budget %.0f MiB)", size / 2**20, tiles.RESIDENT_BUDGET_BYTES / 2**20)
            return "per_call"
        tiles.keep_resident(weights)
        log.info("tiles prompt weights resident: %.0f MiB of dequantised copies", size / 2**20)
        return "resident"

    def _compile(self, kv_caches, decode: dict[str, str], layer_groups: list[int] | None
                 ) -> None:
        started = time.perf_counter()
        m = self.model
        for linear in self.layers if m.compiles else ():
            layers = compiled_layers(self.model, linear)
            if layers.warm_up(self.model):
                self.layers[linear] = layers
            else:
                self.notes.append(f"{linear.name} layers eager (compiling failed)")
        if m.attention.name == "torch" and m.decode_layer is not None:
            templates = "int8" in self.formats and decode["int8"] == "template"
            if templates:
                log.info("compiling the decode step with GEMM templates: minutes with a cold "
                         "Inductor cache")
            shape = (m.norm, m.eps, m.num_heads, m.num_kv_heads, m.head_dim, m.scale)
            layers = tuple(layer.weights() for layer in m.layers)
            structure = StepStructure.of(m, layer_groups, kv_caches)
            for frozen, cpp in candidates(m.device, templates):
                step = DecodeStep(layers, *shape, self.linear, structure, templates=frozen,
                                  cpp_wrapper=cpp)
                if step.warm_up(kv_caches, m.embed.shape[1], m.rotary.cos_sin, m.dtype):
                    self.decode_step = step
                    break
            if self.decode_step is None:
                self.notes.append("decode step unavailable: layer by layer")
            elif templates and not self.decode_step.templates:
                self.notes.append("decode templates unavailable here: kernel")
        log.info("compiled in %.1f s", time.perf_counter() - started)

    @property
    def prompt_row_granule(self) -> int:
        """Prompt rows computed at once: `tiles` pads a step's prompt rows to whole tiles (the
        scheduler fills them); 1 where no prompt rows take tiles."""
        if any(self.plan.prompt[f] == "tiles" for f in self.formats):
            from backend_engine.accel.cpu.tiles import TILE_ROWS

            return TILE_ROWS
        return 1

    def describe(self) -> str:
        """The plan's one start-up line, with what could not run here."""
        notes = f" ({'; '.join(self.notes)})" if self.notes else ""
        return self.plan.describe(self.formats, experts=hasattr(self.model, "num_experts")) + notes

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                 meta: AttentionMetadata) -> torch.Tensor:
        m = self.model
        hidden = m.embed_tokens(input_ids)
        cos, sin = m.rotary.cos_sin(positions)
        nd = meta.num_decode_tokens
        if self.decode_step is not None and nd:
            views = self.decode_step.structure.step_views(meta, kv_caches[0][0].shape[1])
            out = self.decode_step(hidden[:nd], cos[:nd], sin[:nd], kv_caches, views)
            if out is not None:
                if not meta.prefills:
                    return out
                rest = self._prefill_rows(hidden[nd:], cos[nd:], sin[nd:], kv_caches,
                                          meta.prefill_part())
                return torch.cat([out, rest])
        return self._prefill_rows(hidden, cos, sin, kv_caches, meta)

    def _prefill_rows(self, hidden, cos, sin, kv_caches, meta: AttentionMetadata):
        """The rows the decode step does not take: with a prompt Linear of its own, the prompt
        rows in one pass, then the others."""
        if self.prompt_linear is None:
            return self._layers(self.linear, hidden, cos, sin, kv_caches, meta)
        prompt, other = meta.split_prompt_rows()
        if not len(other.rows):
            return self._layers(self.prompt_linear, hidden, cos, sin, kv_caches, meta)
        if not len(prompt.rows):
            return self._layers(self.linear, hidden, cos, sin, kv_caches, meta)
        out = torch.empty_like(hidden)
        for part, linear in ((prompt, self.prompt_linear), (other, self.linear)):
            rows = part.rows.to(hidden.device)
            out[rows] = self._layers(linear, hidden[rows], cos[rows], sin[rows], kv_caches,
                                     part.meta)
        return out

    def _layers(self, linear: Linear, hidden, cos, sin, kv_caches, meta: AttentionMetadata):
        compiled = self.layers[linear]
        if compiled is not None:
            return compiled.run(self.model, hidden, cos, sin, kv_caches, meta)
        return self.model.run_layers(hidden, cos, sin, kv_caches, meta, linear)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.model.compute_logits(hidden, self.linear)
