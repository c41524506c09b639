"""KV cache groups (vLLM's hybrid allocator): a model's layers grouped by attention type, each
group with a block table of its own per sequence, all drawing blocks from one pool.

A model whose layers all attend over the whole context has one group: every block holds every
layer, today's layout. A model that interleaves sliding-window layers with full-attention ones
(Gemma 3) splits its layers into groups of `page_layers` layers each, full-attention groups
first: one block of the pool is one page of memory in each of `page_layers` KV tensors, and the
group that holds the block decides which of its layers the page serves (its i-th layer uses the
i-th tensor). A full-attention group keeps every block of a sequence; a sliding-window group
gives back the blocks that have left its window, so a sliding layer holds about `window`
tokens per sequence however long the sequence grows. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    layers: tuple[int, ...]  # the model's layer indices, in order
    sliding_window: int = 0  # 0: full attention

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window > 0


def kv_cache_groups(layer_windows: list[int]) -> list[KVCacheGroupSpec]:
    """The groups of a model whose layer i attends over `layer_windows[i]` positions (0: all).
    Layers of one window split into groups of the same size, the gcd of the windows' layer
    counts (Gemma 3 270M: 3 full and 15 sliding layers, six groups of three)."""
    by_window: dict[int, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    if len(by_window) == 1:
        window, layers = next(iter(by_window.items()))
        return [KVCacheGroupSpec(tuple(layers), window)]
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    return [KVCacheGroupSpec(tuple(layers[i:i + size]), window)
            for window, layers in sorted(by_window.items())  # full attention (0) first
            for i in range(0, len(layers), size)]


def page_layers(groups: list[KVCacheGroupSpec]) -> int:
    """Layers one block's memory spans: every group has this many."""
    return len(groups[0].layers)


def layer_pages(groups: list[KVCacheGroupSpec], num_layers: int) -> tuple[list[int], list[int]]:
    """For each layer: (its group, the KV tensor among the page's that it uses)."""
    group_of, tensor_of = [0] * num_layers, [0] * num_layers
    for g, spec in enumerate(groups):
        for i, layer in enumerate(spec.layers):
            group_of[layer], tensor_of[layer] = g, i
    return group_of, tensor_of


def hybrid_unsupported_reason(config) -> str | None:
    """Why this engine keeps one group even for a sliding-window model (None: it need not)."""
    if config.disable_hybrid_kv_cache_manager:
        return "--disable-hybrid-kv-cache-manager"
    if config.tensor_parallel_size > 1:
        return "tensor parallelism"
    if config.kv_offload_enabled:
        return "the KV offload tier"
    if config.kv_role != "both":
        return "prefill/decode disaggregation"
    return None


def engine_kv_cache_groups(layer_windows: list[int], config) -> tuple[list[KVCacheGroupSpec],
                                                                       str | None]:
    """The groups the engine runs the model with, and why it keeps one group for a model with
    sliding-window layers (None: it does not): every layer in every block, masked."""
    groups = kv_cache_groups(layer_windows)
    reason = hybrid_unsupported_reason(config) if len(groups) > 1 else None
    if reason is not None:
        groups = [KVCacheGroupSpec(tuple(range(len(layer_windows))))]
    return groups, reason


def sliding_blocks_bound(window: int, max_step_tokens: int, block_size: int) -> int:
    """The most blocks a sliding-window group holds for one sequence: the window before a
    step's first new token and the step's tokens, over block boundaries."""
    return -(-(window - 1 + max_step_tokens) // block_size) + 1


def blocks_for_tokens(groups: list[KVCacheGroupSpec], num_tokens: int, block_size: int,
                      max_step_tokens: int) -> int:
    """The most pool blocks one sequence of num_tokens tokens holds at once, over all groups."""
    blocks = -(-num_tokens // block_size)
    return sum(min(blocks, sliding_blocks_bound(g.sliding_window, max_step_tokens, block_size))
               if g.is_sliding else blocks for g in groups)
