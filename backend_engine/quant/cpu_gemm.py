"""Prompt rows of quantised CPU weights: dequantise to bf16, then a GEMM in fixed row tiles.

torch's weight-only kernels (cpu.py) stream a row at a time: at one row they beat any GEMM, but
from ~16 rows on they are 3-8x slower than bf16's GEMM on CPUs with AMX or AVX512-BF16
(docs/engine/quantization.md has the figures). A prompt's rows come in hundreds, so they take
this form: the weight dequantised to bf16 for the call (int8: the values, exact in bf16, with
the channel scales applied to the output; int4: (q - 8) * scale + zero per group, rounded once
to bf16), then `torch.mm` over tiles of exactly `TILE_ROWS` rows, the last one padded with zero
rows. Prompt tokens take this form, all but the last; the last prompt token (whose logits give
the first output token) and generated tokens keep the weight-only kernel, so a prompt whose
blocks are all cached but its last token's costs a one-row step, not a padded tile.

Why tiles: a BLAS GEMM picks its blocking (and so its summation order) from the row count, so
one call over 37 rows and one over 512 give a row different bits. Every tile here has the same
shape, and a row's bits then depend only on the row itself (checked at every row offset within
a tile and with any neighbours: `tests/backend_engine/quant/test_cpu_gemm.py`), so a prompt gives
the same tokens however the scheduler chunks it, batches it or finds its prefix cached: which
form a token takes depends only on its place in its sequence.

Each kind's conversion and tile loop run as one custom op, so Inductor treats them as a call
and the compiled layers keep them whole; int4's dequantisation inside is compiled on its own for
each weight shape. int4's op runs a weight's compiled GEMM template instead where the model
chose that form (cpu_template.py: faster still, and no per-call dequantisation).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch
from torch.fx.experimental import _config as fx_config

from backend_engine.attention.compiled_decode import own_copy
from backend_engine.quant import cpu_template
from backend_engine.quant.cpu import KERNEL_DTYPE, CpuInt4Weight, CpuInt8Weight

TILE_ROWS = 64  # rows per GEMM call (measured: 32 was ~1.4x slower at 512 rows, 128 pads more)
log = logging.getLogger(__name__)
_BLOCK_N = 64  # torch's int4 CPU layout: output channels in blocks of 64, then the rest


def tiled_mm(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight_t [K, N] in bf16, as calls over `TILE_ROWS` rows each."""
    m = x.shape[0]
    pad = -m % TILE_ROWS
    x = x.to(KERNEL_DTYPE)
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = x.new_empty(m + pad, weight_t.shape[1])
    for start in range(0, m + pad, TILE_ROWS):
        torch.mm(x[start:start + TILE_ROWS], weight_t, out=out[start:start + TILE_ROWS])
    return out[:m]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """torch's blocked CPU int4 layout (`_convert_weight_to_int4pack_for_cpu`, uint8
    [N, K // 2]) back to the values, uint8 [N, K]. Output channels come in blocks of 64 and a
    last block of the rest (a multiple of 16), each block stored input channel by input
    channel: in a block of 64, byte j holds channels j (low nibble) and j + 32; in the last
    block, channels 2j and 2j + 1. Written as one broadcast shift, which Inductor fuses into
    a loop 3-5x faster than a concatenation of the two nibbles, or than a transposed result."""
    n, k = packed.shape[0], packed.shape[1] * 2
    full = n // _BLOCK_N * _BLOCK_N
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=packed.device)
    parts = []
    if full:
        b = packed[:full].reshape(full // _BLOCK_N, k, 1, _BLOCK_N // 2)
        v = (b >> shifts.view(1, 1, 2, 1)) & 15  # [blocks, K, 2, 32]: channels j, j + 32
        parts.append(v.permute(0, 2, 3, 1).reshape(full, k))
    if n > full:
        b = packed[full:].reshape(k, (n - full) // 2, 1)
        parts.append(((b >> shifts) & 15).reshape(k, n - full).t())  # channels 2j, 2j + 1
    return torch.cat(parts) if len(parts) > 1 else parts[0]


_layout_ok: bool | None = None  # int4_layout_checked's answer, once computed


def int4_layout_checked() -> bool:
    """The layout `unpack_int4` reads is the one this torch writes (checked once a process, on
    shapes with both kinds of block; models check at load, so compiled code reads the
    answer); if a torch release changes it, int4 prompt rows keep the kernel."""
    global _layout_ok
    if _layout_ok is None:
        gen = torch.Generator().manual_seed(0)
        ok = True
        for n in (64, 112, 48):
            q = torch.randint(0, 16, (n, 64), dtype=torch.int32, generator=gen)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            ok = ok and torch.equal(unpack_int4(packed).to(torch.int32), q)
        _layout_ok = ok
    return _layout_ok


def dequantize_int4(packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """The grouped weight in bf16 [N_padded, K], from the kernel's own layout."""
    n, k = packed.shape[0], packed.shape[1] * 2
    v = unpack_int4(packed).view(n, k // group_size, group_size).float() - 8.0
    sz = scales_and_zeros.float()  # [K // group_size, N, 2]
    scales, zeros = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]
    return (v * scales + zeros).view(n, k).to(KERNEL_DTYPE)


@torch.library.custom_op("kvgate::int8_tiled_mm", mutates_args=())
def int8_tiled_mm(x: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ the int8 values' transpose (exact in bf16), in `TILE_ROWS`-row tiles; one op,
    so compiled layers do not trace the conversion into their dynamic-row graph."""
    return tiled_mm(x, qweight.to(KERNEL_DTYPE).t())


@int8_tiled_mm.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0], dtype=KERNEL_DTYPE)


def int8_gemm(x: torch.Tensor, w: CpuInt8Weight) -> torch.Tensor:
    y = int8_tiled_mm(x, w.qweight).float() * w.scales_fp32
    return y.to(x.dtype)


class Compiled:
    """fn compiled, eager where Inductor cannot run here; thread-safe (engines of one process
    share it). Static shapes: one graph per shape of its arguments, each a code object of its
    own (no shape counts against another's recompile limit). `dequantize_int4` takes them: one
    fused loop, ~0.8 ms against ~7 ms eager for 3072 x 576 on 2 threads; with dynamic shapes,
    or traced into the compiled layers' graph, whose rows are dynamic, Inductor's loop was
    2-20x slower. Dynamic shapes: one graph for all."""

    def __init__(self, fn: Callable, dynamic: bool = False) -> None:
        self._fn, self._dynamic = fn, dynamic
        self._compiled: dict[tuple, Callable] = {}
        self._failed = False
        self._lock = threading.Lock()

    def __call__(self, *args):
        if self._failed:
            return self._fn(*args)
        key = () if self._dynamic else tuple(
            tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        with self._lock:
            if key not in self._compiled:
                self._compiled[key] = torch.compile(own_copy(self._fn), dynamic=self._dynamic,
                                                    fullgraph=True)
            fn = self._compiled[key]
        try:
            with fx_config.patch(use_duck_shape=False):  # equal sizes stay separate symbols
                return fn(*args)
        except Exception as exc:  # noqa: BLE001 - Inductor raises many kinds; eager always works
            self._failed = True
            log.warning("%s runs eager here (%s)", self._fn.__name__, type(exc).__name__)
            return self._fn(*args)


_fused_dequantize = Compiled(dequantize_int4)


@torch.library.custom_op("kvgate::int4_prompt_mm", mutates_args=())
def int4_prompt_mm(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """x [M, K] @ the int4 weight's transpose for prompt rows: through the weight's compiled
    GEMM template where one is attached (cpu_template.py), else its dequantised transpose in
    `TILE_ROWS`-row tiles. One op, so compiled layers call it (and the static-shape
    dequantisation) instead of tracing it; which of the two a weight takes is fixed at load."""
    template = cpu_template.lookup(packed)
    y = template(x) if template is not None else None
    if y is not None:
        return y
    return tiled_mm(x, _fused_dequantize(packed, scales_and_zeros, group_size).t())


@int4_prompt_mm.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
      group_size: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0], dtype=KERNEL_DTYPE)


def int4_gemm(x: torch.Tensor, w: CpuInt4Weight) -> torch.Tensor:
    if w.perm is not None:
        x = x.index_select(1, w.perm)
    y = int4_prompt_mm(x, w.packed, w.scales_and_zeros, w.group_size)
    if y.shape[1] != w.out_features:
        y = y[:, :w.out_features].contiguous()
    return y.to(x.dtype)


FORMS = {CpuInt8Weight.kind: int8_gemm, CpuInt4Weight.kind: int4_gemm}
