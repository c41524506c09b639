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
`warm_up` compiles both at start-up; a failure leaves the layer-by-layer path in charge.
"""

from __future__ import annotations

import logging
import re

import torch
from torch.fx.experimental import _config as fx_config

from backend_engine.attention.compiled_decode import own_copy, paged_decode
from backend_engine.attention.torch_backend import store_kv
from backend_engine.models.layer_halves import input_half, output_half, rms_norm

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


_FIXED_ARGUMENTS = ("layers", "caches", "final_norm")


def _step_input_guards(entries: list) -> list[bool]:
    """Which of Dynamo's guards to keep: all but those on the weights, norms and KV pools,
    the same objects for a DecodeGraph's whole life (~300 tensors, whose checks took ~0.35 ms
    a step: a twentieth of a one-row int4 step). A guard's name starts with its argument's
    (`layers[3][1]`, `caches[0][0]`)."""
    return [re.split(r"[\[.]", entry.name, maxsplit=1)[0] not in _FIXED_ARGUMENTS
            for entry in entries]


class DecodeGraph:
    """The compiled decode step of one model over one engine's KV caches."""

    def __init__(self, layers: tuple, final_norm: torch.Tensor, eps: float, heads: int,
                 kv_heads: int, head_dim: int, scale: float) -> None:
        # Inductor's wrapper asserts every input's size and stride at each call (~600 asserts
        # here, ~0.4 ms a step): the weights and pools are fixed, the step inputs are guarded
        self._fn = torch.compile(own_copy(_decode_step), dynamic=False, fullgraph=True,
                                 options={"guard_filter_fn": _step_input_guards,
                                          "size_asserts": False, "alignment_asserts": False})
        self._layers, self._final_norm = layers, final_norm
        self._consts = (eps, heads, kv_heads, head_dim, scale)
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
        if hidden.shape[0] > 1:  # one row specialises: its own graph
            for tensor in (hidden, cos, sin, slot_mapping, block_tables, context_lens):
                torch._dynamo.mark_dynamic(tensor, 0)
        torch._dynamo.mark_dynamic(block_tables, 1)
        try:
            with fx_config.patch(use_duck_shape=False):
                return self._fn(hidden, cos, sin, self._layers, caches, self._final_norm,
                                slot_mapping, block_tables, context_lens, *self._consts)
        except Exception as exc:  # noqa: BLE001 - Inductor raises many kinds; eager always works
            self.failed = True
            log.warning("the compiled decode step is unavailable here (%s: %s); running decode "
                        "rows layer by layer", type(exc).__name__,
                        str(exc).splitlines()[0][:200])
            return None

    def warm_up(self, caches: tuple, hidden_size: int, cos_sin) -> bool:
        """Compile now (start-up) for one row and for several. Writes K/V rows of zeros into
        the first slots of the caches, which hold nothing yet. True if it works."""
        dtype, device = self._final_norm.dtype, self._final_norm.device
        self._caches = caches
        with torch.inference_mode():  # inference tensors, as in the engine's steps
            for rows in (1, 3):
                hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
                positions = torch.arange(rows, device=device)
                slots = torch.arange(rows, device=device)
                tables = torch.zeros(rows, 3, dtype=torch.long, device=device)
                lens = torch.arange(1, rows + 1, device=device)
                if self(hidden, *cos_sin(positions), caches, slots, tables, lens) is None:
                    return False
        return True
